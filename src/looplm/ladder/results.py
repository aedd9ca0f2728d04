"""A finished ladder as data, and its tables: results.md's table and results.csv's rows.

The runner (``looplm.ladder.runner``) builds a :class:`Ladder` and writes these tables and
the plots (``looplm.ladder.plots``), which both read it from here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from looplm.config import RunConfig
from looplm.ladder.rungs import MECHANISMS

#: Table 1's columns, in the order of :data:`~looplm.ladder.MECHANISMS`' tuples.
MECHANISM_NAMES = ("tie", "step", "ACT", "2S", "nest", "Q-halt")

#: The α of the training length, where the quartile and last-character figures are read.
REFERENCE_ALPHA = 1.0


@dataclasses.dataclass
class LadderRung:
    """One trained (or reused) rung: its run directory, config and task-evaluation history."""

    rung: str
    run_dir: Path
    config: RunConfig
    parameters: int
    history: list[dict[str, Any]]  # task_eval records in step order, one per step
    reused: bool
    wall_time_s: Optional[float]  # of the session that finished the run
    device: str

    @property
    def block_passes(self) -> int:
        return self.config.model.block_passes

    @property
    def final(self) -> dict[str, Any]:
        """The last task evaluation (at ``train.max_steps``)."""
        return self.history[-1]

    @property
    def mechanisms(self) -> tuple[bool, ...]:
        return MECHANISMS[self.rung]


@dataclasses.dataclass
class Ladder:
    """A finished ladder: what ran, where, and on what machine."""

    task: str
    budget: int
    out_dir: Path
    rungs: list[LadderRung]
    command: str
    machine: dict[str, Any]

    @property
    def alphas(self) -> list[str]:
        """The evaluated α as the records key them (``"1"``, ``"1.5"``, …)."""
        return list(self.rungs[0].final["alphas"]) if self.rungs else []

    @property
    def reference_alpha(self) -> str:
        """α = 1 when evaluated, else the first α."""
        key = f"{REFERENCE_ALPHA:g}"
        return key if key in self.alphas else self.alphas[0]


def _pct(value: Optional[float]) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def results_table(ladder: Ladder) -> str:
    """The markdown table of results.md (accuracies in %, final evaluation)."""
    ref = ladder.reference_alpha
    header = ["rung", *MECHANISM_NAMES, "C", "params"]
    header += [f"α={a} EM / char" for a in ladder.alphas]
    header += [f"Q{q} (α={ref})" for q in range(1, 5)] + [f"last (α={ref})", "steps", "time (s)"]
    rows = []
    for r in ladder.rungs:
        alphas = r.final["alphas"]
        row = [r.rung, *("✓" if m else "" for m in r.mechanisms), str(r.block_passes), f"{r.parameters:,}"]
        row += [f"{_pct(alphas[a]['exact_match'])} / {_pct(alphas[a]['char_acc'])}" for a in ladder.alphas]
        row += [_pct(q) for q in alphas[ref]["quartile_acc"]] + [_pct(alphas[ref]["last_char_acc"])]
        row += [str(r.final["step"]), "–" if r.wall_time_s is None else f"{r.wall_time_s:.0f}"]
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def results_markdown(ladder: Ladder) -> str:
    first = ladder.rungs[0]
    task = first.config.data.task
    m = ladder.machine
    machine = f"{m['cpu']}, {m['cpus']} CPUs, {m['torch_threads']} torch threads, device {m['device']}"
    if "gpu" in m:
        machine += f" ({m['gpu']})"
    lines = [
        f"# Compute-placement ladder: {ladder.task}, C = {ladder.budget} block passes",
        "",
        "```",
        ladder.command,
        "```",
        "",
        f"- looplm {m['looplm']}, torch {m['torch']}, Python {m['python']}, {m['platform']}",
        f"- machine: {machine}",
        f"- every rung: d_model {first.config.model.d_model}, {first.config.model.n_heads} heads, batch "
        f"{first.config.train.batch_size}, lr {first.config.train.lr:g}, {first.config.train.max_steps} steps, "
        f"seed {first.config.train.seed}; L_train {task.train_length}, {task.eval_samples} greedy samples per α",
        "",
        f"Accuracies in % at the last evaluation (EM: exact match, char: character accuracy; Q1–Q4 "
        f"and last: by output quartile and of the last character at α={ladder.reference_alpha}). "
        f"Ticks: Table 1 of autoregressive-trm.txt. Runs: `{ladder.out_dir}/<rung>/`.",
        "",
        results_table(ladder),
        "",
    ]
    return "\n".join(lines)


CSV_FIELDS = ("task", "budget", "rung", "mechanisms", "block_passes", "parameters", "step", "alpha", "length",
              "samples", "exact_match", "char_acc", "q1_acc", "q2_acc", "q3_acc", "q4_acc", "last_char_acc")


def results_rows(ladder: Ladder) -> list[dict[str, Any]]:
    """One row per rung × α of the final evaluation (rates as fractions in [0, 1])."""
    rows = []
    for r in ladder.rungs:
        ticks = "+".join(n for n, on in zip(MECHANISM_NAMES, r.mechanisms) if on)
        for key, m in r.final["alphas"].items():
            rows.append({
                "task": ladder.task, "budget": ladder.budget, "rung": r.rung, "mechanisms": ticks,
                "block_passes": r.block_passes, "parameters": r.parameters, "step": r.final["step"],
                "alpha": m["alpha"], "length": m["length"], "samples": m["samples"],
                "exact_match": m["exact_match"], "char_acc": m["char_acc"],
                **{f"q{q + 1}_acc": v for q, v in enumerate(m["quartile_acc"])},
                "last_char_acc": m["last_char_acc"],
            })
    return rows
