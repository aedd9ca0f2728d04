"""Readable tables of FLOP reports and layout matches (``looplm flops``)."""

from __future__ import annotations

from looplm.accounting.flops import FlopReport
from looplm.accounting.matching import LayoutMatch


def _g(x: float) -> str:
    return f"{x:.4e}"


def format_flops(report: FlopReport) -> str:
    c = report.convention
    lines = [
        f"convention       {c.name}: {c.description}",
        f"input            [{report.batch}, {report.seq_len}]",
        f"forward          {_g(report.forward)} FLOPs  ({_g(report.forward_per_token)} per token)",
        f"training         {_g(report.training)} FLOPs  ({_g(report.training_per_token)} per token, "
        f"{c.training_multiplier:g} x forward{_training_note(report)})",
        "components (forward)",
    ]
    for name, flops in report.components.items():
        share = 100 * flops / report.forward if report.forward else 0.0
        lines.append(f"  {name:<14} {_g(flops):>12}  {share:6.2f}%")
    if report.targets_only:
        lines.append(f"with targets only {_g(sum(report.targets_only.values()))} FLOPs more per forward "
                     "(per-step target readout: Q-halt's without grad, the exit gate's expected objective's "
                     "with grad; in training, not in forward)")
    return "\n".join(lines)


def _training_note(report: FlopReport) -> str:
    notes = []
    if report.no_grad:
        notes.append(f"no-grad passes {_g(report.no_grad)} once")
    if report.targets_only_grad:
        notes.append(f"+ per-step readout {_g(report.targets_only_grad)} x {report.convention.training_multiplier:g}")
    if sum(report.targets_only.values()) > report.targets_only_grad:
        notes.append("+ target readout once")
    if report.training_only:
        notes.append(f"+ training-mode work {_g(report.training_only)} (DSA's indexer-loss scores) "
                     f"x {report.convention.training_multiplier:g}")
    if report.embedding_matmul:
        notes.append("embedding 2 x")
    return "; " + ", ".join(notes) if notes else ""


def format_matches(matches: list[LayoutMatch], by: str, target: str) -> str:
    lines = [f"layouts matching the {by} of {target}"]
    for m in matches:
        lines.append(f"  {m.layout:<14} {_g(m.flops):>12} FLOPs  {m.params:>15,} params  ratio {m.ratio:.4f}")
    return "\n".join(lines)
