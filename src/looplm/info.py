"""Headline facts of a model config: layout, unrolled depth, parameter counts.

The model is built on the ``meta`` device, so describing a 1.4B preset allocates nothing.
A run or checkpoint directory is described from its saved config, plus the structure its
training grew (SGT head loops: block, depth K_l, looping heads S_l).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from looplm.model import LoopLM
from looplm.model_config import ModelConfig
from looplm.accounting import active_parameter_count, count_flops, parameter_counts


def describe(cfg: ModelConfig) -> dict[str, Any]:
    with torch.device("meta"):
        model = LoopLM(cfg)
    layout = cfg.parsed_layout
    topology = cfg.topology.summary(layout.iterations) if layout.is_looped else "none (dense)"
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
        "block": f"{cfg.norm}, {'parallel' if cfg.parallel_residual else 'sequential'} residual, "
                 + (f"{cfg.mlp} FFN {cfg.ffn_hidden}" if cfg.moe is None else "mixture-of-experts FFN (moe)"),
        "parameters": parameter_counts(model),
        "flops": _headline_flops(model, cfg),
        **({"head_loop": _head_loop_summary(cfg)} if cfg.head_loop is not None else {}),
        **({"depth": cfg.depth.summary(layout.iterations)} if cfg.depth.changes_training else {}),
        **(_moe_summary(cfg) if cfg.moe is not None else {}),
    }


def _moe_summary(cfg: ModelConfig) -> dict[str, Any]:
    """The experts and the parameters one token uses (``active_parameters``)."""
    moe = cfg.moe
    sets = "one set per loop iteration" if moe.per_iteration else "one set per block"
    return {"moe": f"{moe.experts} {cfg.mlp} experts of width {moe.width(cfg.ffn_hidden)}, top-{moe.top_k} "
                   f"token choice, dropless, {sets}",
            "active_parameters": active_parameter_count(cfg)}


def _headline_flops(model, cfg: ModelConfig) -> dict[str, Any]:
    """Forward and training FLOPs per token at max_seq_len (``default`` convention)."""
    report = count_flops(model, cfg.max_seq_len)
    return {
        "convention": report.convention.name,
        "seq_len": report.seq_len,
        "forward_per_token": report.forward_per_token,
        "training_per_token": report.training_per_token,
        "forward_per_sequence": report.forward,
    }


def _head_loop_summary(cfg: ModelConfig) -> str:
    h = cfg.head_loop
    what = "block loop" if h.kind == "block" else f"{'all' if h.heads is None else h.heads} {h.select}-entropy heads"
    return (f"{what}, K_max={h.max_depth}, L={h.layers}, t_start={h.start}, Δt={h.interval}, "
            f"{h.direction.replace('_', '-')}, exclude {list(h.exclude)}")


def describe_source(source: Optional[str], overrides: Sequence[str] = (), verify: bool = True) -> dict[str, Any]:
    """describe() of a config (preset or YAML); for a run, checkpoint or save_pretrained
    directory (verified against its manifest unless ``verify=False``), of its saved model
    config plus ``grown`` (block -> depth, heads) and ``step``."""
    if source is not None and Path(source).is_dir():
        from looplm.eval.load import load_run
        from looplm.head_loop.block import grown_structure

        run = load_run(source, verify=verify)
        info = describe(run.config.model)
        info["checkpoint"] = str(run.path)
        if run.config.model.head_loop is not None:
            grown = grown_structure(run.model)
            info["grown"] = {
                name: f"depth {g['depth']}, heads {g['heads']}"
                + ("" if all(w in (0.0, 1.0) for w in g["weights"]) else " (fading: weights " +
                   ", ".join(f"{w:.2f}" for w in g["weights"]) + ")")
                for name, g in grown.items()
            } or "nothing yet (warm-up)"
        return info
    from looplm.config import load_config

    return describe(load_config(source, overrides).model)


def format_description(info: dict[str, Any]) -> str:
    params = info["parameters"]
    lines = [f"{key:<16} {value}" for key, value in info.items() if key not in ("parameters", "grown", "flops", "active_parameters")]
    flops = info.get("flops")
    if flops:
        lines.append(
            f"{'FLOPs/token':<16} {flops['forward_per_token']:.4g} forward, {flops['training_per_token']:.4g} training"
            f" (T={flops['seq_len']}, {flops['convention']} convention; `looplm flops` for the breakdown)"
        )
    grown = info.get("grown")
    if isinstance(grown, dict):
        lines.append(f"{'grown':<16} {len(grown)} looping block(s)")
        lines += [f"  {name:<14} {text}" for name, text in grown.items()]
    elif grown is not None:
        lines.append(f"{'grown':<16} {grown}")
    active = f", {info['active_parameters']:,} active per token" if "active_parameters" in info else ""
    lines.append(f"{'parameters':<16} {params['total']:,} total, {params['non_embedding']:,} non-embedding{active}")
    for name, count in params.items():
        if name not in ("total", "non_embedding"):
            lines.append(f"  {name:<14} {count:>15,}")
    return "\n".join(lines)
