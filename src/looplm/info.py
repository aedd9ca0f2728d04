"""Headline facts of a model config: layout, unrolled depth, parameter counts.

The model is built on the ``meta`` device, so describing a 1.4B preset allocates nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from looplm.model import LoopLM
from looplm.model_config import ModelConfig
from looplm.train.params import parameter_counts


def describe(cfg: ModelConfig) -> dict[str, Any]:
    with torch.device("meta"):
        model = LoopLM(cfg)
    layout = cfg.loop
    topology = cfg.topology.kind if layout.is_looped else "none (dense)"
    if cfg.topology.kind == "mesh" and layout.is_looped:
        topology += f" (B={cfg.buffer_slots})"
    if cfg.topology.kind == "additive":
        topology += " (" + " + ".join(cfg.topology.supplements) + ")"
    return {
        "layout": str(layout),
        "prelude_blocks": layout.prelude,
        "core_blocks": layout.core,
        "iterations": layout.iterations,
        "coda_blocks": layout.coda,
        "share_core": cfg.share_core,
        "unrolled_depth": layout.unrolled_depth,
        "topology": topology,
        "d_model": cfg.d_model,
        "heads": f"{cfg.n_heads} (kv {cfg.kv_heads})",
        "block": f"{cfg.norm}, {'parallel' if cfg.parallel_residual else 'sequential'} residual, {cfg.mlp} FFN {cfg.ffn_hidden}",
        "parameters": parameter_counts(model),
    }


def format_description(info: dict[str, Any]) -> str:
    params = info["parameters"]
    lines = [f"{key:<16} {value}" for key, value in info.items() if key != "parameters"]
    lines.append(f"{'parameters':<16} {params['total']:,} total, {params['non_embedding']:,} non-embedding")
    for name, count in params.items():
        if name not in ("total", "non_embedding"):
            lines.append(f"  {name:<14} {count:>15,}")
    return "\n".join(lines)
