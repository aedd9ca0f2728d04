"""``model.head_loop``: where extra attention depth goes and how it grows (SGT §4, Alg. 1)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from looplm.config_base import Config, check
from looplm.structure import LoopStructure


@dataclasses.dataclass(frozen=True)
class HeadLoopConfig(Config):
    """Extra attention passes grown during training (sparse-growing-transformer.txt §4).

    kind ``heads``: after a block's attention sub-layer, K_l extra pre-norm passes of the
    selected heads S_l only (Eq. 6), then the FFN. kind ``block``: Block Loop, the whole
    block re-applied K_l times (the paper's baseline, App. D.1). Growth (Alg. 1): warm-up
    until step ``start`` (t_start), a decision every ``interval`` steps (Δt) on the EMA
    (``ema_decay``) of the length-normalised last-query entropies (Eqs. 4-5); candidate
    pool C = top-``layers`` (L) layers by mean entropy; the growing layer deepens up to
    ``max_depth`` (K_max) while it stays in C, else the deepest candidate shallower than
    every active layer (``direction: shallow_to_deep``: the shallowest one deeper) is
    activated while fewer than L layers are active; then the structure freezes.
    ``heads``: h heads per layer (null: all heads, the "attention loop" variant);
    ``select``: the ``high``- or ``low``-entropy heads (Table 2). On activation every head
    loops; the others fade out linearly over ``fade`` steps (null: Δt) and are dropped.
    ``exclude``: layers never grown, indices over the model's distinct blocks in depth
    order (default the first, App. C.4). ``kind: block`` activates the top-L layers at
    t_start at depth K_max at once and freezes (the paper's fixed entropy-chosen layers).
    """

    kind: Literal["heads", "block"] = "heads"
    heads: Optional[int] = 2
    select: Literal["high", "low"] = "high"
    max_depth: int = 1
    layers: int = 3
    start: int = 250
    interval: int = 250
    fade: Optional[int] = None
    ema_decay: float = 0.9
    exclude: tuple[int, ...] = (0,)
    direction: Literal["deep_to_shallow", "shallow_to_deep"] = "deep_to_shallow"

    def __post_init__(self) -> None:
        check(self.heads is None or self.heads >= 1, "model.head_loop.heads", self.heads, "null (all heads) or an integer >= 1")
        check(self.max_depth >= 1, "model.head_loop.max_depth", self.max_depth, "an integer >= 1 (K_max)")
        check(self.layers >= 1, "model.head_loop.layers", self.layers, "an integer >= 1 (L)")
        check(self.start >= 1, "model.head_loop.start", self.start, "an integer >= 1 (t_start, a step number)")
        check(self.interval >= 1, "model.head_loop.interval", self.interval, "an integer >= 1 (Δt)")
        check(self.fade is None or self.fade >= 0, "model.head_loop.fade", self.fade, "null (Δt) or an integer >= 0")
        check(0.0 <= self.ema_decay < 1.0, "model.head_loop.ema_decay", self.ema_decay, "a number in [0, 1)")
        check(all(i >= 0 for i in self.exclude), "model.head_loop.exclude", list(self.exclude),
              "a list of block indices >= 0")

    @property
    def fade_steps(self) -> int:
        return self.interval if self.fade is None else self.fade

    @classmethod
    def checked(cls, value, *, structure: LoopStructure, n_heads: int, parallel_residual: bool,
                softmax: bool) -> "HeadLoopConfig":
        """``value`` (a config or, from Python, a dict) checked against the model it grows:
        its ``structure`` (the distinct blocks ``exclude`` indexes), ``n_heads``, whether its
        blocks are ``parallel_residual`` and whether some block computes ``softmax`` attention."""
        cfg = cls.from_dict(value, prefix="model.head_loop") if isinstance(value, dict) else value
        check(cfg.heads is None or cfg.heads <= n_heads, "model.head_loop.heads", cfg.heads,
              f"null or at most n_heads={n_heads}")
        check(cfg.kind == "block" or not parallel_residual, "model.head_loop.kind", cfg.kind,
              "'block' with parallel_residual=true: Eq. (6) feeds the looped state H^(K) to the FFN, "
              "which a parallel block reads from its input; set model.parallel_residual=false")
        blocks = structure.distinct_blocks
        check(all(i < blocks for i in cfg.exclude), "model.head_loop.exclude", list(cfg.exclude),
              f"block indices below {blocks}, the model's number of distinct blocks")
        check(softmax, "model.head_loop", cfg.to_dict(),
              "null: head looping needs softmax attention (attention or sliding_window) in some block")
        return cfg
