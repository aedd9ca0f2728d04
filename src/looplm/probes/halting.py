"""Where the loop spends its steps: realised macro steps per position under a halting rule
(ACT, Q-halt, or none), the ACT weights and Q-halt probabilities per step, and how many
block passes deep the readout sits."""

from __future__ import annotations

import torch

from looplm.probes import plots
from looplm.probes.base import ProbeError, ProbeInput, ProbeReport, register, tolist


def readout_passes(output, passes_per_step: int) -> torch.Tensor:
    """Block passes behind each position's readout, [B, T] float64: under ACT the expected
    depth Σ_τ w_τ·τ·passes_per_step of its weighted readout Σ_τ w_τ h^(τ) (Graves; LT2 App.
    ACT: the weights sum to one), under a terminal readout (Q-halt, none) the passes the
    position ran. In the compute-matched regime (autoregressive-trm.txt App. B.1) every
    position runs all C passes, but ACT's readout may sit far shallower (UT's bias 1:
    about 1.3 of 12, docs/results/ladder/investigation.md §4)."""
    weights = output.record.get("act_weights")
    if not weights:
        return output.block_passes.double()
    depth = torch.arange(1, len(weights) + 1, dtype=torch.float64, device=weights[0].device) * passes_per_step
    return torch.einsum("sbt,s->bt", torch.stack(weights).double(), depth)


@register("halting", "autoregressive-TRM App. B.1, LT2 App. ACT: realised steps per position, ACT weights, Q-halt σ(q)")
def halting(probe: ProbeInput) -> ProbeReport:
    probe.require_loop("halting")
    model = probe.model
    if not model.cfg.halting.adaptive:  # every position runs every step: nothing to show
        raise ProbeError("probe 'halting' needs a halting rule; this model has none (model.halting.kind=none)")
    steps_max = model.cfg.iterations
    counts = torch.zeros(steps_max + 1, dtype=torch.float64)
    by_position: list[torch.Tensor] = []
    passes = torch.zeros((), dtype=torch.float64)
    readout = torch.zeros((), dtype=torch.float64)
    per_step: dict[str, torch.Tensor] = {}
    positions = 0
    for cap in probe.forward():
        record = cap.output.record
        steps = cap.output.halt_steps
        counts += torch.bincount(steps.flatten(), minlength=steps_max + 1).double()
        by_position.append(steps.double().sum(dim=0))
        passes += cap.output.block_passes.double().sum()
        readout += readout_passes(cap.output, model.cfg.passes_per_step).sum()
        positions += steps.numel()
        for name in ("act_weights", "q_halt"):
            if name in record:
                values = torch.stack([v.double().mean() for v in record[name]])
                values = torch.nn.functional.pad(values, (0, steps_max - len(values)))  # steps a stopped loop skipped
                per_step[name] = per_step.get(name, 0) + values * steps.shape[0]
    samples = probe.samples
    histogram = counts[1:] / counts.sum()
    mean_by_position = torch.stack(by_position).sum(dim=0) / samples if by_position else torch.zeros(0)
    numbers = {
        "samples": samples,
        "rule": model.cfg.halting.kind,
        "full_compute": model.cfg.halting.full_compute,
        "macro_steps": steps_max,
        "passes_per_step": model.cfg.passes_per_step,
        "halt_step_fraction": tolist(histogram),
        "mean_halt_step": round(float((torch.arange(1, steps_max + 1) * histogram).sum()), 6),
        "mean_halt_step_by_position": tolist(mean_by_position),
        "block_passes_per_token": round(float(passes / max(positions, 1)), 6),
        "readout_depth": round(float(readout / max(positions, 1)), 6),
        **{f"{name}_mean_by_step": tolist(total / samples) for name, total in per_step.items()},
    }
    labels = [str(t) for t in range(1, steps_max + 1)]
    figures = {"halting": lambda plt: plots.bars(plt, labels, tolist(histogram), None, "fraction of positions",
                                                 f"Halting step ({numbers['rule']})")}
    if per_step:
        series = {name: total / samples for name, total in per_step.items()}
        figures["halting_per_step"] = lambda plt: plots.lines(plt, range(1, steps_max + 1), series, "macro step",
                                                              "mean over positions", "ACT weight / Q-halt σ(q) per step")
    return ProbeReport(numbers, figures)
