"""Shared helpers: tiny model configs spanning the configuration grid."""

from __future__ import annotations

import math
import os

import pytest
import torch

from looplm.ladder import RUNGS, rung_model
from looplm.model_config import TOPOLOGIES, ModelConfig, TopologyConfig

TOPOLOGY_KINDS = [k for k in TOPOLOGIES if k != "additive"]

# The processes tests start (benchmarks, the CLI, torchrun ranks, the Triton interpreter's
# reruns) single-threaded as well, unless the caller says otherwise: beside the other test
# worker on 2 cores, a child's spinning OpenMP threads made tests/test_benchmarks.py's launch
# count 99 s instead of 68.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models run fastest single-threaded, and do not fight other processes for cores:
    beside other busy processes on 2 cores, PyTorch's spinning intra-op threads made the
    CPU tests 10-20× slower (tests/gpu and the invariants: 428 s, single-threaded 18 s).
    Session-wide, so that module fixtures (a trained ladder) run single-threaded too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(topology: str = "base", layout: str = "1+2R2+1", **overrides) -> ModelConfig:
    """A CPU-sized model; ``topology`` may be any kind ('additive' sums anchor+anchor*)."""
    fields = dict(
        vocab_size=61,
        d_model=32,
        n_heads=4,
        layout=layout,
        topology=TopologyConfig.from_dict(
            {"kind": "additive", "supplements": ["anchor", "anchor_embedding"]} if topology == "additive"
            else {"kind": topology}
        ),
        max_seq_len=128,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def all_configs() -> list[tuple[str, ModelConfig]]:
    """Every topology, plus dense, unshared-core and block-shape variants."""
    grid = [(f"topology={k}", tiny_config(k)) for k in [*TOPOLOGY_KINDS, "additive"]]
    grid += [
        ("dense", tiny_config("base", layout="3")),
        ("mesh-unshared", tiny_config("mesh", share_core=False)),
        ("anchor-llama-gqa", tiny_config("anchor", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2)),
        ("mesh-neox", tiny_config("mesh", parallel_residual=True, rotary_pct=0.25, layout="2R3", embed_scale=True)),
        ("residual-tied", tiny_config("residual", tie_embeddings=True, layout="1+1R3")),
        ("swa-anchor", tiny_config("anchor", mixer={"kind": "sliding_window", "window": 4})),
        ("gated-attention-mesh", tiny_config("mesh", mixer={"kind": "attention", "output_gate": True})),
        ("gated-swa-dense", tiny_config("base", layout="3", mixer={"kind": "sliding_window", "window": 3, "output_gate": True})),
        ("loop-level-windows", tiny_config("anchor", layout="1+1R3+1", loop_mixers=[
            {"kind": "attention"}, {"kind": "sliding_window", "window": 4}, {"kind": "sliding_window", "window": 2}])),
        ("depth-hybrid-bookend", tiny_config("mesh", mixer={"kind": "sliding_window", "window": 3},
                                             hybrid={"mixer": {"kind": "attention"}, "ratio": "1:1", "placement": "bookend"})),
        ("hybrid-full-gdn-gated", tiny_config("gated_residual", layout="5R2", mixer={"kind": "gated_deltanet"},
                                              hybrid={"mixer": {"kind": "attention"}, "ratio": "4:1"})),
        ("hybrid-gdn-dsa-mesh", tiny_config("mesh", mixer={"kind": "dsa", "top_k": 3, "index_heads": 2, "index_head_dim": 8},
                                            hybrid={"mixer": {"kind": "gated_deltanet"}, "ratio": "1:1"})),
        ("mamba2-anchor", tiny_config("anchor", mixer={"kind": "mamba2"})),
        ("kda-static", tiny_config("static_combination", mixer={"kind": "kda"})),
        ("nsa-residual", tiny_config("residual", mixer={"kind": "nsa", "block_size": 2, "select_blocks": 3, "window": 3})),
        ("loop-level-kinds", tiny_config("anchor", layout="1R3", loop_mixers=[
            {"kind": "attention"}, {"kind": "gated_deltanet"}, {"kind": "sliding_window", "window": 3}])),
        ("spiral-mesh", tiny_config("mesh", layout="1+1x{1/4,1/2,1}+1")),
        ("spiral-mean-uniform", tiny_config("anchor", layout="1+1x{1/2,1}+1", resolution={"down": "mean", "up": "uniform"})),
        ("sgt-heads-grown", tiny_config("anchor", head_loop={"kind": "heads", "heads": 2})),
        ("sgt-block-grown", tiny_config("base", layout="3", head_loop={"kind": "block"})),
        ("ut-act-adaptive-anchor", tiny_config("anchor", layout="1+1R3", step_embeddings=True,
                                               halting={"kind": "act", "ponder_cost": 0.1})),
        ("ar-trm-adaptive", tiny_config("base", layout="1R2", streams={"kind": "two", "outer": 2, "inner": 1},
                                        halting={"kind": "qhalt"}, step_embeddings=True)),
        ("nested-act-prelude-coda", tiny_config("base", layout="1+1R2+1", streams={"kind": "two", "inner": 2},
                                                halting={"kind": "act"})),
        ("learned-positions", tiny_config("residual", position="learned")),
        ("ouro-sandwich", tiny_config("base", layout="2R3", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2,
                                      norm_placement="sandwich", loop_input_norm=True,
                                      halting={"kind": "exit_gate", "threshold": 0.5})),
        ("sandwich-neox-anchor", tiny_config("anchor", norm_placement="sandwich", parallel_residual=True)),
        # Ouro's fixed exit step and Stage I objective (the objective acts on the loss, not the logits)
        ("ouro-fixed-exit-expected", tiny_config("base", layout="1R3", norm="rmsnorm", mlp="swiglu", bias=False,
                                                 norm_placement="sandwich", loop_input_norm=True,
                                                 halting={"kind": "exit_gate", "exit_at_step": 1,
                                                          "objective": "expected"})),
        # Ouro's Stage II: the gate trained alone on a frozen LM (the objective acts on the loss)
        ("ouro-stage-two", tiny_config("base", layout="2R3", norm="rmsnorm", mlp="swiglu", bias=False,
                                       norm_placement="sandwich", loop_input_norm=True,
                                       halting={"kind": "exit_gate", "threshold": 0.5, "objective": "improvement"})),
        # zero-shot exit (Huginn's KL criterion, and entropy): init_std 0.3 sharpens the
        # distributions so that positions exit at different steps, none near the threshold
        ("zero-shot-exit-kl", tiny_config("anchor", layout="1+1R3+1", init_std=0.3,
                                          halting={"kind": "convergence", "criterion": "kl", "threshold": 0.02})),
        ("zero-shot-exit-entropy-two-streams", tiny_config(
            "base", layout="1R3", init_std=0.3, streams={"kind": "two", "outer": 1, "inner": 1},
            step_embeddings=True, halting={"kind": "convergence", "criterion": "entropy", "threshold": 2.6})),
    ]
    # per-iteration LoRA on the shared core (Relaxed Recursive Transformers; ``grow`` moves B_t off zero)
    grid += [
        ("lora-anchor", tiny_config("anchor", layout="1+2R3+1", lora={"rank": 2})),
        ("lora-llama-gqa-loop-windows", tiny_config("residual", layout="1R3", norm="rmsnorm", mlp="swiglu", bias=False,
                                                    n_kv_heads=2, lora={"rank": 3}, loop_mixers=[
            {"kind": "attention"}, {"kind": "sliding_window", "window": 4}, {"kind": "attention"}])),
        ("lora-mlp-gdn-mesh", tiny_config("mesh", mixer={"kind": "gated_deltanet"},
                                          lora={"rank": 2, "targets": ["mlp"]})),
        ("lora-spiral-gated", tiny_config("anchor", layout="1+1x{1/2,1}+1", mixer={"kind": "attention", "output_gate": True},
                                          lora={"rank": 1})),
        ("lora-nested-act", tiny_config("base", layout="1+1R2+1", streams={"kind": "two", "inner": 2},
                                        halting={"kind": "act"}, lora={"rank": 2})),
        # Mixture-of-Recursions, routers at bias 0 so positions leave at different steps. Not here:
        # selection=top_k, whose *training* forward is not causal by design (top-k over the
        # sequence); tests/halting/test_mor.py checks it against the same invariants (its
        # inference form) and shows the training leak.
        ("mor-expert-choice-anchor", tiny_config("anchor", layout="1+1R3+1",
                                                 halting={"kind": "mor", "depths": 3, "init_bias": 0.0})),
        ("mor-token-choice-steps", tiny_config("residual", layout="1R3", step_embeddings=True,
                                               halting={"kind": "mor", "depths": 3, "routing": "token_choice",
                                                        "init_bias": 0.0})),
        # recursion-wise KV: later steps see only the positions taking them (their depths kept by
        # every cache kind)
        ("mor-token-choice-recursion-kv", tiny_config("anchor", layout="1+1R3+1",
                                                      halting={"kind": "mor", "depths": 3, "init_bias": 0.0,
                                                               "routing": "token_choice", "kv": "recursion"})),
        # recursive KV sharing: later steps attend over the first step's keys and values (grouped heads)
        ("mor-expert-shared-kv-gqa", tiny_config("anchor", layout="1+1R3+1", n_kv_heads=2,
                                                 halting={"kind": "mor", "depths": 3, "init_bias": 0.0, "kv": "shared"})),
        # Huginn: latent state + concat adapter, a count drawn per step, backprop through the last 2
        ("huginn-sampled-depth", tiny_config("concat_adapter", layout="1+1R3+1", norm="rmsnorm", mlp="swiglu",
                                             bias=False, norm_placement="sandwich", embed_scale=True,
                                             depth={"kind": "lognormal_poisson", "backprop_window": 2})),
        ("huginn-fixed-window-gdn", tiny_config("concat_adapter", layout="2R4", mixer={"kind": "gated_deltanet"},
                                                depth={"kind": "fixed", "backprop_window": 1})),
        # mixture-of-experts FFNs (issue 29): experts shared by the loop, and one set per iteration
        ("moe-swiglu-mesh", tiny_config("mesh", norm="rmsnorm", mlp="swiglu", bias=False,
                                        moe={"experts": 4, "top_k": 2, "hidden": 24, "z_loss_weight": 0.001})),
        ("moe-per-iteration-anchor", tiny_config("anchor", layout="1+1R3+1", moe={
            "experts": 3, "top_k": 1, "hidden": 40, "per_iteration": True, "normalize_weights": True})),
    ]
    grid += [(f"ladder-{rung}", ladder_config(rung, 6)) for rung in RUNGS]
    return grid


def ladder_config(rung: str, budget: int, **overrides) -> ModelConfig:
    """A tiny model of one compute-placement rung at ``budget`` block passes (nested: H=1, L=2)."""
    fields = rung_model(rung, budget, outer=1, inner=2)
    fields.pop("topology")
    return tiny_config("base", **{**fields, **overrides})


#: grown structure per ``all_configs`` entry: {block index: (K_l, head weights)}, written by ``grow``
GROWN = {
    "sgt-heads-grown": {1: (2, [1.0, 0.0, 0.5, 1.0]), 3: (1, [0.0, 1.0, 0.0, 0.0])},
    "sgt-block-grown": {1: (1, None)},
}


def grow(name: str, model) -> None:
    """Set the grown SGT structure of ``all_configs`` entry ``name`` (no-op for others), with
    the looping heads arranged in consecutive slots as growth leaves them (narrow passes;
    tests/head_loop covers the gathering passes of unarranged heads); and any per-iteration
    adapters away from their zero init (:func:`relax_adapters`)."""
    blocks = model.blocks()
    for layer, (depth, weights) in GROWN.get(name, {}).items():
        blocks[layer].head_loop.set(depth, weights)
        if weights is not None and hasattr(blocks[layer], "arrange_heads"):
            blocks[layer].arrange_heads([h for h, w in enumerate(weights) if w > 0])
    relax_adapters(model)


def relax_adapters(model, seed: int = 1) -> None:
    """Move every per-iteration LoRA B_t off its zero init (no-op without adapters), so that
    iteration t's view of a core linear really differs from the shared weight."""
    from looplm.modules.lora import IterationLoRA

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, IterationLoRA):
                for B in module.B:
                    B.copy_(torch.randn(B.shape, generator=g) * 0.3)


def random_ids(batch: int, length: int, vocab: int = 61, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights of O(1) activations, norm gains and biases far from 1 and 0, different per
    layer: HF's 0.02 init leaves attention almost uniform and layers alike, which would hide
    a wrong rotary, head order or layer map."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif p.ndim == 1:
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))
