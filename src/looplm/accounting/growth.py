"""Training FLOPs of a run whose structure grows (SGT, sparse-growing-transformer.txt §4).

A forward's FLOPs depend on the grown structure the blocks hold (``block.head_loop``: K_l and
the heads with w_i > 0), which changes during training: a layer is activated with all
heads looping, the non-selected heads fade out over ``fade`` steps, and the growth freezes
after L layers reach K_max. The total training compute (SGT Tables 1-2) is therefore the
sum over steps of each step's training FLOPs under the structure it ran with.

:func:`growth_timeline` replays Algorithm 1 (``GrowthSchedule``, the model's own growth
code) on a scripted, stable entropy ranking (deeper layers higher, the ideal case where
the growing layer stays in the pool), so every decision happens at its earliest step;
:func:`training_flops_over_steps` sums the counter over any per-step structure.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

from torch import nn

from looplm.accounting.conventions import Convention
from looplm.accounting.flops import build_meta_model, count_flops
from looplm.model_config import ModelConfig

#: per step, {block index (model.blocks() order): (K_l, head weights or None for all ones)}
Structure = dict[int, tuple[int, Optional[Sequence[float]]]]


def growth_timeline(cfg: ModelConfig, steps: int) -> list[Structure]:
    """The structure each of ``steps`` optimiser steps (1 .. steps) runs with, from
    ``GrowthSchedule`` on entropies ranked deep over shallow, heads ranked by index. Step s
    runs with the structure written after step s − 1 (``Growth.apply``)."""
    from looplm.head_loop.block import grown_blocks
    from looplm.head_loop.schedule import GrowthSchedule

    model = build_meta_model(cfg)
    loop = cfg.head_loop
    eligible = [l for l in grown_blocks(model) if l not in loop.exclude]
    schedule = GrowthSchedule(loop, cfg.n_heads, eligible)
    entropies = {l: [0.5 + 0.01 * l + 1e-4 * (cfg.n_heads - i) for i in range(cfg.n_heads)] for l in eligible}
    timeline, current = [], {}
    for step in range(1, steps + 1):
        timeline.append(dict(current))  # what step s runs with
        schedule.observe(entropies)
        schedule.advance(step)
        current = {l: (k, list(w)) for l, (k, w) in schedule.structure(step).items()}
    return timeline


def training_flops_over_steps(
    cfg: Union[ModelConfig, nn.Module], seq_len: int, batch: int, structures: Iterable[Structure],
    convention: Union[str, Convention] = "sgt",
) -> float:
    """Σ over steps of the training FLOPs of ``batch`` sequences of ``seq_len`` tokens with
    that step's structure written into the blocks' loops. Structures differing only in
    which heads loop cost the same and are counted once."""
    from looplm.head_loop.block import grown_blocks

    model = build_meta_model(cfg) if isinstance(cfg, ModelConfig) else cfg
    blocks = grown_blocks(model)
    cache: dict[tuple, float] = {}
    total = 0.0
    for structure in structures:
        key = tuple(sorted((l, k, sum(1 for w in (ws or [1.0] * blocks[l].head_loop.n_heads) if w > 0))
                           for l, (k, ws) in structure.items() if k > 0))
        if key not in cache:
            for l, block in blocks.items():
                depth, weights = structure.get(l, (0, None))
                block.head_loop.set(depth, weights)
            cache[key] = count_flops(model, seq_len, batch=batch, convention=convention).training
        total += cache[key]
    for block in blocks.values():
        block.head_loop.set(0)
    return total
