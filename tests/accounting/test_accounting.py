"""Accounting: parameter counts vs formula and papers, FLOPs vs the papers' tables and
vs torch.utils.flop_counter on the modules that run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from looplm.accounting import analytic_parameter_counts, count_flops, match_layouts, parameter_counts
from looplm.accounting.flops import build_meta_model
from looplm.accounting.growth import growth_timeline, training_flops_over_steps
from looplm.accounting.hardware import mfu, peak_flops
from looplm.config import load_config
from looplm.config_base import ConfigError
from looplm.model import LoopLM
from looplm.train import parameter_counts as train_parameter_counts

TINY = ["tiny-dense", "tiny-mesh", "tiny-base", "tiny-dynamic_combination", "tiny-static_combination",
        "tiny-gated_residual", "tiny-lt2-window", "tiny-lt2-gdn", "tiny-lt2-hybrid-full-gdn",
        "tiny-lt2-loop-coarse-to-fine", "tiny-llama-mesh", "spiralformer-b-tiny", "spiralformer-l-tiny",
        "sgt-tiny-k2", "sgt-tiny-block-loop"]


def model_cfg(name, **changes):
    cfg = load_config(name).model
    return dataclasses.replace(cfg, **changes) if changes else cfg


@pytest.mark.parametrize("name", TINY)
def test_parameter_counts_match_formula(name):
    cfg = model_cfg(name)
    counts = parameter_counts(build_meta_model(cfg))
    assert counts == analytic_parameter_counts(cfg)
    assert train_parameter_counts is parameter_counts


def test_mesh_table6_parameters():
    """MeSH Table 6 (Pythia-1.4B). Non-embedding and router counts match exactly; MeSH's
    totals carry one more 4096 × 2048 table than looplm builds (docs/accounting.md)."""
    vanilla = parameter_counts(build_meta_model(model_cfg("pythia-1.4b")))
    recursive = parameter_counts(build_meta_model(model_cfg("pythia-1.4b-4+8R2+4-base")))
    mesh = parameter_counts(build_meta_model(model_cfg("pythia-1.4b-4+8R2+4-mesh")))
    assert vanilla["non_embedding"] == 1_208_602_624
    assert recursive["non_embedding"] == 805_736_448
    assert mesh["non_embedding"] == 805_797_918
    assert mesh["topology"] == 61_470
    extra = 4096 * 2048
    assert (vanilla["total"] + extra, recursive["total"] + extra, mesh["total"] + extra) == (
        1_423_036_416, 1_020_170_240, 1_020_231_710)


def test_mesh_table7_flops():
    """MeSH Table 7: fvcore-like forward GFLOPs at [1, 4096]. The overheads of +residual,
    +anchor and +mesh (Eq. 8) match to the printed digits; the base total is 0.142 GFLOPs
    (0.0026 %) below the table."""
    g = {kind: count_flops(model_cfg(f"pythia-1.4b-4+8R2+4-{kind}"), 4096, convention="mesh").forward / 1e9
         for kind in ("base", "residual", "anchor", "mesh")}
    assert g["base"] == pytest.approx(5373.792, rel=5e-5)
    assert round(g["residual"] - g["base"], 4) == 0.0168
    assert round(g["anchor"] - g["base"], 4) == 0.0168
    assert round(g["mesh"] - g["base"], 4) == 0.7551
    assert 3 * 6 * 4096 * 2048 * 5 / 1e9 == pytest.approx(g["mesh"] - g["base"], rel=2e-4)  # Eq. (8)


SPIRAL = [  # (preset, layout, TFLOPs at 4096 prefill) from SpiralFormer Table 1
    ("pythia-160m", None, 1.65), ("pythia-160m", "2+4R2+2", 1.65),
    ("pythia-410m", None, 4.59), ("pythia-410m", "4+8R2+4", 4.59),
    ("pythia-1b", None, 9.67), ("pythia-1b", "3+5R2+3", 9.67),
    ("pythia-1.4b", None, 14.08), ("pythia-1.4b", "4+8R2+4", 14.08),
]


@pytest.mark.parametrize("preset,layout,tflops", SPIRAL)
def test_spiralformer_table1_full_resolution(preset, layout, tflops):
    """Baselines and LoopedFormer rows: 2 FLOPs/MAC, full score/value products, head
    counted; within 1.5 % (the table's own rounding and an unexplained +0.3–1.2 %)."""
    cfg = model_cfg(preset, **({"layout": layout, "topology": {"kind": "anchor"}} if layout else {}))
    assert count_flops(cfg, 4096, convention="spiralformer").forward / 1e12 == pytest.approx(tflops, rel=0.015)


SPIRAL_MULTI = [  # (preset, TFLOPs at 4096 prefill, non-embedding params in M) from SpiralFormer Table 1
    ("spiralformer-b-160m", 1.48, 56.8), ("spiralformer-l-160m", 1.49, 85.1),
    ("spiralformer-b-410m-anchor", 4.10, 201.6), ("spiralformer-b-410m", 4.11, 201.6),
    ("spiralformer-l-410m", 4.16, 302.4), ("spiralformer-b-1b", 8.95, 554.1), ("spiralformer-l-1b", 8.96, 805.9),
    ("spiralformer-b-1.4b", 12.92, 805.9), ("spiralformer-l-1.4b", 13.13, 1208.8),
]


@pytest.mark.parametrize("preset,tflops,non_embedding", SPIRAL_MULTI)
def test_spiralformer_table1_multiresolution(preset, tflops, non_embedding):
    """SpiralFormer-B/L: the core on L_t complete chunks per iteration, S↓/S↑ counted; we
    count 0.2-1.1 % less than the table, the same one-sided gap as the full-resolution
    rows above (so 1.5 %). Non-embedding parameters (with scorers and routers) match to
    the printed digit; totals for 1B/1.4B with MeSH's extra 4096 × d table."""
    cfg = model_cfg(preset)
    assert count_flops(cfg, 4096, convention="spiralformer").forward / 1e12 == pytest.approx(tflops, rel=0.015)
    counts = parameter_counts(build_meta_model(cfg))
    assert counts == analytic_parameter_counts(cfg) and counts["resolution"] > 0
    assert round(counts["non_embedding"] / 1e6, 1) == non_embedding


def test_spiralformer_table1_totals():
    totals = {"spiralformer-b-1b": 768.6, "spiralformer-l-1b": 1020.4, "spiralformer-b-1.4b": 1020.4,
              "spiralformer-l-1.4b": 1423.2}
    for preset, total in totals.items():
        cfg = model_cfg(preset)
        total_m = (parameter_counts(build_meta_model(cfg))["total"] + 4096 * cfg.d_model) / 1e6
        assert total_m == pytest.approx(total, abs=0.06)  # B-1.4B: 1020.35 vs 1020.4 (docs/accounting.md)


def test_resolution_costs_scale_with_chunks():
    """Iteration t's core runs on ⌊(T + ω_t)/g_t⌋ positions; S↓/S↑ add their own steps."""
    cfg = model_cfg("spiralformer-b-tiny")
    report = count_flops(cfg, 64)
    assert {"resolution.down.0", "resolution.up.0"} <= set(report.steps) and report.components["resolution"] > 0
    mean = count_flops(dataclasses.replace(cfg, resolution={"down": "mean", "up": "uniform"}), 64)
    assert mean.components["resolution"] < report.components["resolution"]
    full = count_flops(model_cfg("tiny-mesh", layout="1+2R4+1"), 64)
    assert report.components["core"] < full.components["core"]


SGT = {  # training FLOPs (1e18): Vanilla, Block Loop, SGT K=1,2,3 (sparse-growing-transformer.txt Table 1)
    "275m": (42.83, 51.50, 43.46, 43.88, 44.21),
    "573m": (87.41, 101.76, 88.15, 88.60, 88.96),
    "1.2b": (175.76, 205.65, 177.06, 177.85, 178.48),
}
SGT_STEPS, SGT_BATCH, SGT_LEN = 5035, 1024, 4096  # §5.1


def _sgt_total(cfg, structures):
    return training_flops_over_steps(cfg, SGT_LEN, SGT_BATCH, structures, convention="sgt") / 1e18


@pytest.mark.parametrize("size", list(SGT))
def test_sgt_table1_training_flops(size):
    """`sgt` convention summed over the 5035 steps. SGT: the growth schedule replayed
    (Alg. 1, each layer looping all heads for its fade window Δt, then h = 2). Block Loop:
    the 3 layers re-applied over the whole run (the table's +% equals 3 full layers from
    step 0, not from t_start). All 15 numbers within 0.011e18 (the table's rounding)."""
    vanilla, block, *sgt = SGT[size]
    assert _sgt_total(model_cfg(f"sgt-{size}-vanilla"), [{}] * SGT_STEPS) == pytest.approx(vanilla, abs=0.011)
    cfg = model_cfg(f"sgt-{size}-block-loop")
    n = len(build_meta_model(cfg).blocks())
    assert _sgt_total(cfg, [{l: (1, None) for l in range(n - 3, n)}] * SGT_STEPS) == pytest.approx(block, abs=0.011)
    for k, expected in zip((1, 2, 3), sgt):
        cfg = model_cfg(f"sgt-{size}-k{k}")
        assert _sgt_total(cfg, growth_timeline(cfg, SGT_STEPS)) == pytest.approx(expected, abs=0.011)


def test_sgt_table2_loop_components():
    """573M, one layer looped once for the whole run (App. D.2): Block Loop 92.20, all-head
    Attention Loop 89.01, High/Low-Ent. head loop 87.74. The head loop's two-stage selection
    (all 16 heads, then 10, then 2, windows of Δt = 250) gives 87.72: 0.02e18 (0.02 %) short."""
    cfg = model_cfg("sgt-573m-k1")
    H, layer = cfg.n_heads, 7
    two, ten = [1.0] * 2 + [0.0] * (H - 2), [1.0] * 10 + [0.0] * (H - 10)
    assert _sgt_total(cfg, [{layer: (1, None)}] * SGT_STEPS) == pytest.approx(89.01, abs=0.011)
    staged = [{layer: (1, None)}] * 250 + [{layer: (1, ten)}] * 250 + [{layer: (1, two)}] * (SGT_STEPS - 500)
    assert _sgt_total(cfg, staged) == pytest.approx(87.74, abs=0.03)
    block = model_cfg("sgt-573m-block-loop")
    assert _sgt_total(block, [{layer: (1, None)}] * SGT_STEPS) == pytest.approx(92.20, abs=0.011)


def test_head_loop_flops_from_grown_structure():
    """A head pass of |S| heads costs |S|/H of an all-heads pass's attention; Block Loop a whole block."""
    model = build_meta_model(model_cfg("sgt-tiny-k1"))
    base = count_flops(model, 64, convention="torch").forward
    block = model.blocks()[2]
    block.head_loop.set(1, [1.0] * model.cfg.n_heads)
    one_all = count_flops(model, 64, convention="torch").forward - base
    block.head_loop.set(2, [1.0] + [0.0] * (model.cfg.n_heads - 1))
    two_one = count_flops(model, 64, convention="torch").forward - base
    assert two_one == pytest.approx(2 * one_all / model.cfg.n_heads)
    block.head_loop.set(0)


def measured(model, x, **kwargs):
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(x, **kwargs)
    return fc.get_flop_counts()["Global"]


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-mesh", "tiny-dynamic_combination", "tiny-lt2-window",
                                  "tiny-lt2-loop-coarse-to-fine", "spiralformer-b-tiny", "spiralformer-l-tiny",
                                  "sgt-tiny-k2", "sgt-tiny-block-loop"])
def test_attention_models_match_flop_counter(name):
    """With explicit attention probabilities the score/value products are matmuls that
    FlopCounterMode counts over all pairs: the ``torch`` convention equals it exactly
    (SGT presets with a grown structure: block 2 at depth 2, two heads fading in)."""
    torch.manual_seed(0)
    model = LoopLM(model_cfg(name)).eval()
    if model.cfg.head_loop is not None:
        model.blocks()[2].head_loop.set(2, [1.0, 0.5] + [0.0] * (model.cfg.n_heads - 2))
    x = torch.randint(0, model.cfg.vocab_size, (2, 48))
    counts = measured(model, x, output_attentions=True)
    assert count_flops(model, 48, batch=2, convention="torch").forward == sum(counts.values())


LINEAR = ["tiny-lt2-gdn", "tiny-lt2-retnet", "tiny-lt2-gla", "tiny-lt2-mamba2", "tiny-lt2-hgrn2",
          "tiny-lt2-deltanet", "tiny-lt2-kda", "tiny-lt2-linear-attention"]


@pytest.mark.parametrize("name", LINEAR)
def test_linear_mixer_projections_match_flop_counter(name):
    """Projections, short convolutions, FFN and head (mm / addmm / convolution) equal
    FlopCounterMode exactly; the chunkwise core (bmm) is reported by formula."""
    torch.manual_seed(0)
    model = LoopLM(model_cfg(name)).eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, 64))
    counts = measured(model, x)
    dense = sum(v for op, v in counts.items() if str(op).split(".")[-1] in ("mm", "addmm", "convolution"))
    report = count_flops(model, 64, batch=2, convention="torch")
    macs = sum(c.mac for c in report.costs.values())
    if name == "tiny-lt2-linear-attention":  # its Hadamard feature maps run per head as addmm
        assert 2 * macs + 2 * sum(c.mixer_chunk for c in report.costs.values()) == sum(counts.values())
    else:
        assert 2 * macs == dense


@pytest.mark.parametrize("T", [12, 40])
def test_dsa_counts_the_indexer_work_that_runs(T):
    """DSA (top_k 16): an inference forward scores only the queries at positions >= top_k
    and, with none there (T = 12), projects only the index key: the projections equal
    FlopCounterMode's mm/addmm exactly in both cases; a training forward scores every query
    (the indexer loss), which ``training`` counts and ``forward`` does not."""
    from looplm.accounting.cost import Call, module_cost
    from looplm.mixers.dsa import DeepSeekSparseAttention

    torch.manual_seed(0)
    model = LoopLM(model_cfg("tiny-lt2-dsa")).eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, T))
    counts = measured(model, x)
    dense = sum(v for op, v in counts.items() if str(op).split(".")[-1] in ("mm", "addmm"))
    report = count_flops(model, T, batch=2, convention="torch")
    assert 2 * sum(c.mac for c in report.costs.values()) == dense

    (dsa, *_) = [m for m in model.modules() if isinstance(m, DeepSeekSparseAttention)]
    idx, top_k = dsa.indexer, dsa.top_k
    per_index_pair, per_pair = idx.heads * (idx.head_dim + 1), dsa.n_heads * 2 * dsa.head_dim
    kept = sum(min(p + 1, top_k) for p in range(T))
    scored_inference = sum(p + 1 for p in range(top_k, T))  # queries past top_k, their causal keys
    scored_training = sum(p + 1 for p in range(T))
    index_proj = module_cost(idx.q_proj, Call(1, T, T)).mac + module_cost(idx.w_proj, Call(1, T, T)).mac
    inference, training = module_cost(dsa, Call(1, T, T)), module_cost(dsa, Call(1, T, T, training=True))
    assert inference.attn_causal == kept * per_pair + scored_inference * per_index_pair
    assert training.attn_causal == kept * per_pair + scored_training * per_index_pair
    assert training.mac - inference.mac == (index_proj if T <= top_k else 0)
    passes = model.cfg.block_passes  # every block of the preset is DSA
    conv, call = report.convention, Call(2, T, T)
    more = passes * (module_cost(dsa, dataclasses.replace(call, training=True)).flops(conv)
                     - module_cost(dsa, call).flops(conv))
    assert report.training_only == pytest.approx(more) and report.training_only > 0
    no_extra = dataclasses.replace(report, training_only=0.0, training_only_grad=0.0)
    assert report.training == pytest.approx(no_extra.training + report.convention.training_multiplier * more)


def test_conventions_change_the_count():
    cfg = model_cfg("tiny-mesh")
    full = count_flops(cfg, 256, convention="spiralformer").forward
    causal = count_flops(cfg, 256, convention="default").forward
    fv = count_flops(cfg, 256, convention="mesh").forward
    assert full > causal > fv
    r = count_flops(cfg, 256)
    assert r.training == 3 * r.forward and r.forward_per_token == r.forward / 256
    assert sum(r.components.values()) == r.forward


def test_looped_core_counted_per_iteration():
    two = count_flops(model_cfg("tiny-base", layout="2+4R2+2"), 128).components["core"]
    four = count_flops(model_cfg("tiny-base", layout="2+4R4+2"), 128).components["core"]
    assert four == 2 * two


def test_match_layouts_finds_the_papers_recursive_layout():
    target = model_cfg("pythia-160m")
    matches = match_layouts(target, target, by="flops", seq_len=512, top=20)
    assert all(m.ratio == pytest.approx(1, abs=1e-9) for m in matches[:5])
    assert "2+4R2+2" in [m.layout for m in matches]
    by_params = match_layouts(target, 100e6, by="params", seq_len=512)
    assert abs(by_params[0].ratio - 1) < 0.1


def test_mfu():
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert peak_flops("some cpu", torch.float32) is None
    assert mfu(1e9, 1e5, 1e15) == pytest.approx(0.1)
    assert mfu(1e9, 1e5, None) is None


@pytest.mark.parametrize("overrides", [dict(share_core=False), dict(layout="1x{1/2,1}"), dict(lora={"rank": 2}),
                                       dict(moe={"experts": 3, "top_k": 1, "per_iteration": True}),
                                       dict(topology={"kind": "mesh"}, step_embeddings=True)])
def test_count_flops_refuses_an_iteration_count_the_forward_refuses(overrides):
    """count_flops(iterations=r) runs the forward's check: it crashed (IndexError) or counted a
    forward that cannot run where the forward refuses r with a ConfigError."""
    from tests.conftest import random_ids, tiny_config

    fields = {"layout": "1R2", **overrides}
    topology = fields.pop("topology", {"kind": "anchor"})["kind"]
    model = LoopLM(tiny_config(topology, **fields))
    with pytest.raises(ConfigError) as forward_err:
        model(random_ids(1, 4), iterations=3)
    with pytest.raises(ConfigError) as count_err:
        count_flops(model, 12, batch=2, iterations=3)
    assert count_err.value.field == forward_err.value.field == "iterations"
    assert count_flops(model, 12, iterations=2).forward > 0  # the trained count still counts
