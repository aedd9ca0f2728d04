"""A study size's learning-rate sweep (:class:`~looplm.study.definition.Sweep`): before the
seeds, every run trains at seed 0 at each rate of the sweep under its shorter budget, in
``out_dir/lr-sweep/lr-RATE/RUN/seed-0`` (reused when finished, like every study run), and
keeps the rate with the best primary metric. While a run's best rate is the lowest (highest)
it has tried, it also tries half (twice) that rate, up to ``Sweep.extend`` times: an
optimum on the sweep's edge is not one. A run whose measures lack the primary metric (a
task part of a two-part variant) keeps the size's rate. The table of every rate's value,
the chosen one in bold, is written to ``out_dir/lr-sweep.md`` and ``lr-sweep.csv``.

A sweep that compares variants at their own best rates answers "which architecture is
better", not "which is better at one untuned rate" (issue 28: SpiralFormer's own check put
lr 4e-3 ~0.07 nats ahead of the study's 2e-3 for both models).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from looplm.artifacts import write_text
from looplm.study.definition import Study, Sweep
from looplm.study.results import csv_text
from looplm.study.runs import SWEEP_DIR

if TYPE_CHECKING:
    from looplm.config import RunConfig
    from looplm.study.runs import Run

logger = logging.getLogger("looplm")

SWEEP_FIELDS = ("run", "lr", "metric", "value", "chosen")


def with_lr(cfg: "RunConfig", lr: float) -> "RunConfig":
    """``cfg`` with ``train.lr`` replaced (the run directory unchanged)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=lr))


def run_lr_sweep(study: Study, size: str, out_dir: Path, overrides: Sequence[str], runs: Sequence[str],
                 train: Callable[[str, int, "RunConfig"], "Run"], measure: Callable[["Run"], dict],
                 write_tables: bool = True) -> dict[str, float]:
    """The chosen rate of each of ``runs`` (run name -> lr), after training and measuring the
    sweep with ``train(name, seed, cfg)`` and ``measure(run)``; writes the sweep's tables
    (``write_tables``)."""
    sweep = study.size(size).sweep
    metric = study.primary
    if sweep is None or metric is None:
        return {}
    values: dict[str, dict[float, Optional[float]]] = {name: {} for name in runs}

    def configs_at(lr: float) -> dict[str, "RunConfig"]:
        return sweep_configs(study, size, out_dir, overrides, lr)

    def sweep_run(name: str, lr: float, configs: dict[str, "RunConfig"]) -> None:
        logger.info("study %s (%s): lr sweep %g: %s", study.name, size, lr, name)
        value = measure(train(name, 0, configs[name]))["scalars"].get(metric.key)
        values[name][lr] = value if value is not None and math.isfinite(value) else None

    for lr in sweep.lrs:
        configs = configs_at(lr)  # built once per rate for every run
        for name in runs:
            sweep_run(name, lr, configs)
    pick = min if metric.better == "lower" else max
    chosen = {}
    for name, by_lr in values.items():
        for extension in range(sweep.extend + 1):
            defined = {lr: v for lr, v in by_lr.items() if v is not None}
            if not defined:
                break
            chosen[name] = best = pick(defined, key=defined.get)
            tried = sorted(by_lr)  # a rate that diverged counts as tried
            if extension == sweep.extend or best not in (tried[0], tried[-1]):
                break
            lr = best / 2 if best == tried[0] else best * 2
            sweep_run(name, lr, configs_at(lr))
    if write_tables:
        _write_tables(out_dir, study, values, chosen, sweep.overrides)
    return chosen


def sweep_configs(study: Study, size: str, out_dir: Path, overrides: Sequence[str], lr: float
                  ) -> dict[str, "RunConfig"]:
    """Every run's config in ``size``'s sweep at rate ``lr``: seed 0, the sweep's budget,
    trained in ``out_dir``/lr-sweep/lr-RATE."""
    budget = study.size(size).sweep.overrides
    return study.configs(size, out_dir / SWEEP_DIR / f"lr-{lr:g}", 0, [*overrides, *budget, f"train.lr={lr!r}"])


def reachable_rates(sweep: Sweep) -> set[float]:
    """Every rate ``sweep`` may train a run at: its own, and those its edge extension reaches
    (halving the lowest or doubling the highest, ``sweep.extend`` times at most)."""
    low, high = min(sweep.lrs), max(sweep.lrs)
    return set(sweep.lrs) | {low / 2**k for k in range(1, sweep.extend + 1)} | {
        high * 2**k for k in range(1, sweep.extend + 1)}


def _write_tables(out_dir: Path, study: Study, values: dict[str, dict[float, Optional[float]]],
                  chosen: dict[str, float], budget: Sequence[str]) -> None:
    metric = study.primary
    lrs = sorted({lr for by_lr in values.values() for lr in by_lr})
    lines = [f"# Learning-rate sweep: {study.title}", "",
             f"Seed 0, every run at each rate under `{' '.join(budget) or 'the size budget'}`; each run's seeds then "
             f"train at its rate in bold (the best {metric.label}, {metric.better} is better; a run whose best was "
             "the edge of its rates also tried past it; – : not run at that rate, or not measured: the run keeps "
             "the size's rate).", "",
             "| run | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "|" + " --- |" * (len(lrs) + 1)]
    rows = []
    for name, by_lr in values.items():
        cells = []
        for lr in lrs:
            if lr not in by_lr:
                cells.append("–")
                continue
            value = by_lr[lr]
            text = "–" if value is None else f"{value:.{metric.digits}f}"
            cells.append(f"**{text}**" if chosen.get(name) == lr else text)
            rows.append({"run": name, "lr": lr, "metric": metric.key, "value": value, "chosen": chosen.get(name) == lr})
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    write_text(out_dir / f"{SWEEP_DIR}.md", "\n".join(lines) + "\n", atomic=True)
    write_text(out_dir / f"{SWEEP_DIR}.csv", csv_text(SWEEP_FIELDS, rows), atomic=True)
