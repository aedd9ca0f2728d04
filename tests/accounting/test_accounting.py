"""Accounting: parameter counts vs formula and papers, FLOPs vs the papers' tables and
vs torch.utils.flop_counter on the modules that run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from looplm.accounting import analytic_parameter_counts, count_flops, match_layouts, parameter_counts
from looplm.accounting.flops import build_meta_model
from looplm.accounting.hardware import mfu, peak_flops
from looplm.config import load_config
from looplm.model import LoopLM
from looplm.train import parameter_counts as train_parameter_counts

TINY = ["tiny-dense", "tiny-mesh", "tiny-base", "tiny-dynamic_combination", "tiny-static_combination",
        "tiny-gated_residual", "tiny-lt2-window", "tiny-lt2-gdn", "tiny-lt2-hybrid-full-gdn",
        "tiny-lt2-loop-coarse-to-fine", "tiny-llama-mesh"]


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


@pytest.mark.xfail(reason="multi-resolution recursion (SpiralFormer-B/L) is not implemented yet: "
                   "the plan's per-iteration resolution r_t is ready, the scaler's own cost is not", strict=False)
def test_spiralformer_table1_multiresolution():
    cfg = model_cfg("pythia-1.4b", layout="4+8x{1/8,1/4,1/2,1}+4", topology={"kind": "mesh"})
    assert count_flops(cfg, 4096, convention="spiralformer").forward / 1e12 == pytest.approx(12.92, rel=0.015)


@pytest.mark.skip(reason="SGT Tables 1-2 need SGT's LLaMA sizes (Table 8) and head looping, built concurrently")
def test_sgt_training_flops():
    pass


def measured(model, x, **kwargs):
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(x, **kwargs)
    return fc.get_flop_counts()["Global"]


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-mesh", "tiny-dynamic_combination", "tiny-lt2-window",
                                  "tiny-lt2-loop-coarse-to-fine"])
def test_attention_models_match_flop_counter(name):
    """With explicit attention probabilities the score/value products are matmuls that
    FlopCounterMode counts over all pairs: the ``torch`` convention equals it exactly."""
    torch.manual_seed(0)
    model = LoopLM(model_cfg(name)).eval()
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
