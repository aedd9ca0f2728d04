"""Find loop layouts whose compute or parameter count matches a target.

``match_layouts(cfg, target, by="flops")`` answers "which P+CRT+Q layout of this block
has the FLOPs of a dense 24-layer model?" (MeSH / SpiralFormer compare at matched
compute: 4+8R2+4 against 24 layers). Candidates are every P+CRT+Q with P + C + Q ≤
``max_blocks`` (P = Q unless ``symmetric`` is false) and T in ``iterations``; they are
ranked by a linear estimate (FLOPs grow with the unrolled depth, parameters with the
stored blocks) and the best are counted exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Union

from looplm.accounting.conventions import Convention
from looplm.accounting.flops import count_flops
from looplm.accounting.params import analytic_parameter_counts
from looplm.config_base import ConfigError
from looplm.layout import parse_layout
from looplm.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LayoutMatch:
    """A candidate layout, its forward FLOPs (per sequence), total parameters, and its
    measure relative to the target (1.0 = exact match)."""

    layout: str
    flops: float
    params: int
    ratio: float


def _measure(cfg: ModelConfig, by: str, seq_len: int, convention) -> tuple[float, int]:
    flops = count_flops(cfg, seq_len, convention=convention).forward
    return flops, analytic_parameter_counts(cfg)["total"]


def _with_layout(cfg: ModelConfig, layout: str) -> Optional[ModelConfig]:
    try:
        return dataclasses.replace(cfg, layout=layout)
    except ConfigError:
        return None  # e.g. a loop_mixers schedule for another iteration count


def match_layouts(
    cfg: ModelConfig,
    target: Union[ModelConfig, float],
    *,
    by: str = "flops",
    seq_len: Optional[int] = None,
    convention: Union[str, Convention] = "default",
    iterations: Iterable[int] = range(2, 7),
    max_blocks: Optional[int] = None,
    symmetric: bool = True,
    top: int = 5,
) -> list[LayoutMatch]:
    """Recursive layouts of ``cfg``'s block whose FLOPs (``by="flops"``) or total
    parameters (``by="params"``) are closest to ``target`` (a config, e.g. the dense
    24-layer model, or a number), best first."""
    if by not in ("flops", "params"):
        raise ConfigError("by", by, "flops or params")
    seq_len = seq_len or cfg.max_seq_len
    if isinstance(target, ModelConfig):
        goal = _measure(target, by, seq_len, convention)[0 if by == "flops" else 1]
        max_blocks = max_blocks or target.parsed_layout.unrolled_depth
    else:
        goal = float(target)
    max_blocks = max_blocks or cfg.parsed_layout.unrolled_depth
    shapes = []
    for T in iterations:
        for C in range(1, max_blocks + 1):
            for P in range(0, max_blocks - C + 1):
                for Q in ([P] if symmetric else range(0, max_blocks - C - P + 1)):
                    if P + C + Q <= max_blocks:
                        shapes.append((P, C, T, Q))
    if not shapes:
        return []

    # linear estimate from two exact counts: FLOPs ~ a + b·unrolled, params ~ c + e·stored
    def key(shape) -> float:
        P, C, T, Q = shape
        return (P + C * T + Q) if by == "flops" else (P + C + Q)

    exact: dict[str, LayoutMatch] = {}

    def measure(shape) -> Optional[LayoutMatch]:
        P, C, T, Q = shape
        text = "+".join(([str(P)] if P else []) + [f"{C}R{T}"] + ([str(Q)] if Q else []))
        if text not in exact:
            candidate = _with_layout(cfg, text)
            if candidate is None:
                return None
            flops, params = _measure(candidate, by, seq_len, convention)
            value = flops if by == "flops" else params
            exact[text] = LayoutMatch(str(parse_layout(text)), flops, params, value / goal)
        return exact[text]

    lo, hi = min(shapes, key=key), max(shapes, key=key)
    a, b = measure(lo), measure(hi)
    if a is None or b is None or key(hi) == key(lo):
        ranked = shapes
    else:
        va, vb = (a.flops, b.flops) if by == "flops" else (a.params, b.params)
        slope = (vb - va) / (key(hi) - key(lo))
        ranked = sorted(shapes, key=lambda s: abs(va + slope * (key(s) - key(lo)) - goal))
    results = [m for m in (measure(s) for s in ranked[: 3 * top]) if m is not None]
    return sorted(results, key=lambda m: (round(abs(m.ratio - 1), 9), m.params))[:top]
