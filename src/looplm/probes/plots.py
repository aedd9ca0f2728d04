"""Figures in the style of the papers' figures. Every function takes ``plt`` (pyplot,
imported by :func:`pyplot` only when figures are written) and returns a Figure, so the
probes' numbers never need matplotlib."""

from __future__ import annotations

from typing import Sequence

import torch

from looplm.errors import MissingExtra


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend, or a clear error."""
    try:
        import matplotlib
    except ImportError as err:
        raise MissingExtra(
            "probe figures need matplotlib: pip install 'looplm[plot]' (or pass --no-figures / figures=False "
            "to write the JSON numbers only)"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _np(x):
    return torch.as_tensor(x).double().cpu().numpy()


def minmax(x: torch.Tensor) -> torch.Tensor:
    """Min–max normalise to [0, 1]; all zeros if the range is negligible or not finite
    (SpiralFormer Fig. 5)."""
    x = x.double()
    lo, hi = x.min(), x.max()
    if not torch.isfinite(hi - lo) or float(hi - lo) < 1e-12:
        return torch.zeros_like(x)
    return (x - lo) / (hi - lo)


def bars(plt, labels: Sequence[str], means, stds, ylabel: str, title: str):
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(labels)), 3.5))
    ax.bar(range(len(labels)), means, yerr=stds, capsize=3, color="tab:blue", alpha=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig


def _draw_matrix(plt, ax, m, rows, cols, title, annotate, vmin=None, vmax=None):
    data = _np(m)
    im = ax.imshow(data, cmap="viridis", aspect="auto", vmin=vmin, vmax=vmax)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)
    if annotate and data.size <= 400:
        for i in range(data.shape[0]):
            for j in range(data.shape[1]):
                if data[i, j] == data[i, j]:
                    ax.text(j, i, f"{data[i, j]:.2f}", ha="center", va="center", fontsize=6, color="w")
    plt.colorbar(im, ax=ax)


def matrix(plt, m, rows, cols, title: str, annotate: bool = False, vmin=None, vmax=None):
    fig, ax = plt.subplots(figsize=(max(4.5, 0.5 * len(cols) + 2), max(3.5, 0.4 * len(rows) + 1.5)))
    _draw_matrix(plt, ax, m, rows, cols, title, annotate, vmin, vmax)
    fig.tight_layout()
    return fig


def matrices(plt, panels, rows, cols, title: str):
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 1, 3.2))
    for ax, (m, name) in zip(axes, panels):
        _draw_matrix(plt, ax, m, rows, cols, name, annotate=False, vmin=0, vmax=1)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def curves(plt, means: dict, stds: dict, xlabel: str, ylabel: str, title: str, log_y: bool = False):
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in means.items():
        m, s = _np(m), _np(stds[name])
        x = range(len(m))
        ax.plot(x, m, label=name)
        ax.fill_between(x, m - s, m + s, alpha=0.2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def boxes(plt, groups: Sequence[torch.Tensor], labels: Sequence[str], ylabel: str, title: str):
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(groups)), 3.5))
    data = [_np(g) for g in groups]
    ax.boxplot(data)
    ax.set_xticks(range(1, len(labels) + 1), labels)
    ax.plot(range(1, len(data) + 1), [d.mean() if d.size else float("nan") for d in data], "ko-", markersize=4)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    return fig


def head_heatmap(plt, values: torch.Tensor, marked: torch.Tensor, layers: Sequence[str], title: str):
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(max(4, 0.5 * values.shape[1] + 2), max(2.5, 0.5 * values.shape[0] + 1.5)))
    _draw_matrix(plt, ax, values, layers, [f"h{h}" for h in range(values.shape[1])], title, annotate=False, vmin=0, vmax=1)
    for l, h in marked.nonzero().tolist():
        ax.add_patch(Rectangle((h - 0.5, l - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2))
    fig.tight_layout()
    return fig


def unrolled(plt, labels: Sequence[str], series: dict, ylabel: str, title: str):
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(labels)), 3.5))
    for name, y in series.items():
        ax.plot(range(len(labels)), _np(y), "o-", label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def lines(plt, x: Sequence[int], series: dict, xlabel: str, ylabel: str, title: str):
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, y in series.items():
        ax.plot(list(x), _np(y), "o-", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return fig


def panels(plt, labels: Sequence[str], series: dict, boundaries: Sequence[int], title: str, log_panels=()):
    fig, axes = plt.subplots(1, len(series), figsize=(4.5 * len(series), 3.5))
    for ax, (name, y) in zip(axes, series.items()):
        ax.plot(range(len(labels)), _np(y), "o-", markersize=3)
        for b in boundaries:
            ax.axvline(b - 0.5, linestyle="--", color="gray", linewidth=0.8)
        if name in log_panels:
            ax.set_yscale("log")
        ax.set_xticks(range(len(labels)), labels, rotation=70, ha="right", fontsize=6)
        ax.set_title(name, fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def lens(plt, x: Sequence[int], result: dict):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name in ("coda", "direct"):
        a1.plot(x, result[name]["loss"], "o-", label=f"{name} readout")
        a2.plot(x, result[name]["accuracy"], "o-", label=f"{name} readout")
    a1.axhline(result["model"]["loss"], color="gray", linestyle="--", label="model")
    a2.axhline(result["model"]["accuracy"], color="gray", linestyle="--", label="model")
    for ax, name in ((a1, "next-token loss"), (a2, "next-token accuracy")):
        ax.set_xticks(list(x), result["states"])
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.suptitle("Cross-loop logit lens")
    fig.tight_layout()
    return fig
