"""The learning-rate schedule: linear warmup, then cosine decay to a floor.

A pure function of the step, not a ``LambdaLR``: the trainer writes ``lr_at(step, cfg)``
into every parameter group before each optimiser step, so a resumed run needs no
scheduler state and reproduces the schedule exactly.
"""

from __future__ import annotations

import math

from looplm.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimiser step ``step`` (0-based: the number of steps already taken).

    * warmup, ``step < W`` (``W = cfg.warmup``): ``lr · (step + 1) / (W + 1)``, rising
      linearly and never 0, so the first step already moves the weights;
    * decay, ``W <= step <= max_steps``: ``floor + (lr - floor) · ½(1 + cos(π · p))`` with
      ``p = (step - W) / (max_steps - W)`` and ``floor = min_lr_ratio · lr``; the peak
      ``lr`` is at ``step = W`` and the floor is reached at ``step = max_steps``;
    * after ``max_steps`` (a run extended on resume): the floor.
    """
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    peak, floor = cfg.lr, cfg.min_lr_ratio * cfg.lr
    warmup = cfg.warmup
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    if step >= cfg.max_steps:
        return floor
    progress = (step - warmup) / (cfg.max_steps - warmup)  # max_steps > warmup (TrainConfig checks it)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
