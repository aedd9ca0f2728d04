"""A study's figures: curves (mean over seeds, band ± std) and grouped bars (± std), one
line or bar per table row.

matplotlib is optional (``pip install 'looplm[plot]'``): without it :func:`write_plots` logs a
note and writes nothing, and the tables stand alone. Figures are drawn on
``matplotlib.figure.Figure`` objects, never through pyplot, so writing them neither needs a
display nor changes the caller's backend.
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path

from looplm.study.definition import Bars, Curve
from looplm.study.results import StudyResult, mean_std

logger = logging.getLogger("looplm")


def write_plots(result: StudyResult) -> list[Path]:
    """The study's figures in ``result.out_dir``; the paths written (none without matplotlib)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("plots skipped: matplotlib is not installed (pip install 'looplm[plot]'); "
                       "results.md and results.csv are written")
        return []
    written = []
    for spec in result.study.figures:
        fig = Figure(figsize=(6.4, 4.0), layout="constrained")
        ax = fig.subplots()
        (_curve if isinstance(spec, Curve) else _bars)(ax, result, spec)
        path = result.out_dir / spec.file
        fig.savefig(path, dpi=120)
        written.append(path)
    return written


def _nan(v):
    return float("nan") if v is None else v


def _curve(ax, result: StudyResult, spec: Curve) -> None:
    for variant in result.variants:
        by_x: dict[float, list[float]] = {}
        for series in result.series(variant, spec.series):
            for x, y in series:
                if y is not None and math.isfinite(y):
                    by_x.setdefault(float(x), []).append(float(y))
        if not by_x:
            continue
        xs = sorted(by_x)
        means = [statistics.fmean(by_x[x]) for x in xs]
        stds = [statistics.stdev(by_x[x]) if len(by_x[x]) > 1 else 0.0 for x in xs]
        (line,) = ax.plot(xs, means, marker=".", label=variant)
        ax.fill_between(xs, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                        color=line.get_color(), alpha=0.15, linewidth=0)
    if spec.logx:
        ax.set_xscale("log")
    if spec.ylim is not None:
        ax.set_ylim(*spec.ylim)
    ax.set_xlabel(spec.xlabel)
    ax.set_ylabel(spec.ylabel)
    ax.set_title(f"{result.study.name}: {spec.title}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _bars(ax, result: StudyResult, spec: Bars) -> None:
    variants = result.variants
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        stats = [mean_std(result.values(variant, key)) for key in spec.metrics]
        xs = [g + (i - (len(variants) - 1) / 2) * width for g in range(len(spec.metrics))]
        ax.bar(xs, [_nan(m) for m, _ in stats], width, yerr=[0.0 if s is None else s for _, s in stats],
               capsize=2, label=variant)
    ax.set_xticks(range(len(spec.metrics)), list(spec.labels))
    ax.set_ylabel(spec.ylabel)
    ax.set_title(f"{result.study.name}: {spec.title}", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
