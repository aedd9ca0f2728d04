"""The ladder's figures, after autoregressive-trm.txt Figs. 4–6: one line (or bar group) per rung.

matplotlib is optional (``pip install 'looplm[plot]'``): without it :func:`write_plots` logs a
note and writes nothing, and the ladder's tables stand alone. Figures are drawn on
``matplotlib.figure.Figure`` objects, never through pyplot, so writing them neither needs a
display nor changes the caller's backend.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from looplm.ladder.results import Ladder

logger = logging.getLogger("looplm")


def write_plots(ladder: Ladder) -> list[Path]:
    """accuracy.png, quartiles.png, length.png and last_char.png in ``ladder.out_dir``; the paths
    written (none without matplotlib)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("plots skipped: matplotlib is not installed (pip install 'looplm[plot]'); "
                       "results.md and results.csv are written")
        return []
    ref = ladder.reference_alpha
    figures: dict[str, Callable[[Any, Ladder, str], None]] = {
        "accuracy.png": _accuracy_over_training,
        "quartiles.png": _quartiles,
        "length.png": _length_generalisation,
        "last_char.png": _last_char_over_training,
    }
    written = []
    for name, draw in figures.items():
        fig = Figure(figsize=(6.4, 4.0), layout="constrained")
        draw(fig.subplots(), ladder, ref)
        path = ladder.out_dir / name
        fig.savefig(path, dpi=120)
        written.append(path)
    return written


def _title(ax, ladder: Ladder, what: str) -> None:
    ax.set_title(f"{ladder.task}, C = {ladder.budget}: {what}", fontsize=10)


def _over_training(ax, ladder: Ladder, ref: str, metric: str, ylabel: str) -> None:
    for r in ladder.rungs:
        steps = [e["step"] for e in r.history]
        values = [e["alphas"][ref][metric] for e in r.history]
        ax.plot(steps, [float("nan") if v is None else v for v in values], marker=".", label=r.rung)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _accuracy_over_training(ax, ladder: Ladder, ref: str) -> None:
    """Fig. 6: held-out character accuracy at L_train over training."""
    _over_training(ax, ladder, ref, "char_acc", f"character accuracy (α={ref})")
    _title(ax, ladder, "learning dynamics")


def _last_char_over_training(ax, ladder: Ladder, ref: str) -> None:
    """Fig. 5: the final-character bottleneck over training."""
    _over_training(ax, ladder, ref, "last_char_acc", f"last-character accuracy (α={ref})")
    _title(ax, ladder, "last character over training")


def _quartiles(ax, ladder: Ladder, ref: str) -> None:
    """Fig. 4: final accuracy by output quartile, one bar group per quartile."""
    width = 0.8 / max(1, len(ladder.rungs))
    for i, r in enumerate(ladder.rungs):
        values = [float("nan") if v is None else v for v in r.final["alphas"][ref]["quartile_acc"]]
        ax.bar([q + (i - (len(ladder.rungs) - 1) / 2) * width for q in range(4)], values, width, label=r.rung)
    ax.set_xticks(range(4), [f"Q{q}" for q in range(1, 5)])
    ax.set_xlabel("output quartile")
    ax.set_ylabel(f"character accuracy (α={ref})")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    _title(ax, ladder, "accuracy by output position")


def _length_generalisation(ax, ladder: Ladder, ref: str) -> None:
    """Final character accuracy against L_eval / L_train."""
    for r in ladder.rungs:
        records = list(r.final["alphas"].values())
        ax.plot([m["alpha"] for m in records], [float("nan") if m["char_acc"] is None else m["char_acc"]
                                                 for m in records], marker="o", label=r.rung)
    ax.set_xlabel("α = L_eval / L_train")
    ax.set_ylabel("character accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _title(ax, ladder, "length generalisation")
