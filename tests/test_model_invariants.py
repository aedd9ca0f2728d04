"""DESIGN.md invariants 1-2 for every configuration: strict causality, cache equivalence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from looplm import LoopCache, LoopLM
from looplm.config import load_config, preset_names
from tests.conftest import TOPOLOGY_KINDS, all_configs, grow, random_ids, tiny_config
from tests.invariants import (
    assert_decodes_like_full_forward,
    assert_static_decodes_like_full_forward,
    assert_strictly_causal,
    prefill_then_tokens,
)

GRID = all_configs()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _model(cfg, name: str = "") -> LoopLM:
    model = LoopLM(cfg).eval()
    grow(name, model)  # the SGT entries of the grid carry a grown head-loop structure
    return model


@pytest.mark.parametrize("name,cfg", GRID, ids=[n for n, _ in GRID])
def test_strict_causality(name, cfg):
    assert_strictly_causal(_model(cfg, name), random_ids(2, 15), (0, 6, 14), shift=7, vocab=cfg.vocab_size)


@pytest.mark.parametrize("name,cfg", GRID, ids=[n for n, _ in GRID])
@pytest.mark.parametrize("prefill", [1, 6])
def test_cache_equivalence(name, cfg, prefill):
    assert_decodes_like_full_forward(_model(cfg, name), random_ids(3, 13), [prefill_then_tokens(prefill, 13)], atol=2e-5)


@pytest.mark.parametrize("name,cfg", GRID, ids=[n for n, _ in GRID])
def test_chunked_prefill_equivalence(name, cfg):
    """Several tokens at a time against a non-empty cache (explicit offset mask)."""
    assert_decodes_like_full_forward(_model(cfg, name), random_ids(2, 12), [[5, 9, 12]], atol=2e-5)


@pytest.mark.parametrize("name,cfg", GRID, ids=[n for n, _ in GRID])
def test_static_cache_equivalence(name, cfg):
    """Prefill, then single tokens and a chunk against the static cache (spare rows after)."""
    x = random_ids(2, 13)
    reason = assert_static_decodes_like_full_forward(_model(cfg, name), x, [6, 7, 8, 11, 12, 13], atol=2e-5,
                                                     capacity=20)
    assert reason is None, reason


MIXER_SPECS = [
    {"kind": "attention"}, {"kind": "attention", "output_gate": True}, {"kind": "sliding_window", "window": 3},
    {"kind": "linear_attention"}, {"kind": "retnet"}, {"kind": "gla"}, {"kind": "hgrn2"}, {"kind": "mamba2"},
    {"kind": "deltanet"}, {"kind": "gated_deltanet"}, {"kind": "kda"},
    {"kind": "nsa", "block_size": 2, "select_blocks": 3, "window": 3},
    {"kind": "dsa", "top_k": 3, "index_heads": 2, "index_head_dim": 8},
]


@settings(max_examples=40, deadline=None)
@given(
    topology=st.sampled_from([*TOPOLOGY_KINDS, "additive"]),
    prelude=st.integers(0, 2),
    core=st.integers(1, 2),
    iterations=st.integers(1, 3),
    coda=st.integers(0, 2),
    share_core=st.booleans(),
    parallel=st.booleans(),
    swiglu=st.booleans(),
    length=st.integers(2, 11),
    split=st.integers(1, 10),
    mixer=st.sampled_from(MIXER_SPECS),
)
def test_invariants_over_config_space(topology, prelude, core, iterations, coda, share_core, parallel, swiglu,
                                      length, split, mixer):
    layout = f"{prelude}+{core}R{iterations}+{coda}"
    cfg = tiny_config(
        topology, layout=layout, share_core=share_core, parallel_residual=parallel,
        mlp="swiglu" if swiglu else "gelu", norm="rmsnorm" if swiglu else "layernorm", mixer=mixer,
    )
    model = _model(cfg)
    x = random_ids(2, length, seed=length)
    full = model(x).logits
    split = min(split, length - 1)
    cache = LoopCache()
    pieces = [model(x[:, :split], cache=cache).logits]
    pieces += [model(x[:, i : i + 1], cache=cache).logits for i in range(split, length)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=2e-5, rtol=1e-5)
    assert_static_decodes_like_full_forward(model, x, [split, *range(split + 1, length + 1)], atol=2e-5, capacity=16)
    y = x.clone()
    y[:, split] = (y[:, split] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(y).logits[:, :split], full[:, :split], atol=1e-6, rtol=0)


def test_left_padding_matches_unpadded_rows():
    model = _model(tiny_config("mesh"))
    short, long_ = random_ids(1, 5, seed=1), random_ids(1, 9, seed=2)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), short], dim=1)
    batch = torch.cat([padded, long_])
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    out = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(out[0, 4:], model(short).logits[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], model(long_).logits[0], atol=2e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


def test_cache_crop_and_select_batch():
    model = _model(tiny_config("anchor"))
    x = random_ids(3, 10)
    full = model(x).logits
    cache = LoopCache()
    model(x[:, :8], cache=cache)
    cache.crop(6)
    assert cache.get_seq_length() == 6
    torch.testing.assert_close(model(x[:, 6:7], cache=cache).logits[:, 0], full[:, 6], atol=2e-5, rtol=1e-5)
    cache.select_batch(torch.tensor([2, 0]))
    torch.testing.assert_close(model(x[[2, 0], 7:8], cache=cache).logits[:, 0], full[[2, 0], 7], atol=2e-5, rtol=1e-5)


def test_decoding_after_padded_prefill_needs_no_mask():
    """The cache remembers padding: later steps without attention_mask stay correct."""
    model = _model(tiny_config("anchor"))
    short = random_ids(1, 4, seed=3)
    batch = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    cache = LoopCache()
    model(batch, attention_mask=mask, cache=cache)
    nxt = random_ids(1, 1, seed=4)
    stepped = model(nxt, cache=cache).logits[0, -1]
    torch.testing.assert_close(stepped, model(torch.cat([short, nxt], 1)).logits[0, -1], atol=2e-5, rtol=1e-5)


LT2_MODELS = sorted(name.removeprefix("lt2-0.6b-") for name in preset_names() if name.startswith("lt2-0.6b-"))


def test_every_lt2_model_has_both_paper_sizes_and_a_tiny_preset():
    names = set(preset_names())
    assert len(LT2_MODELS) == 14  # LT2 Table 2: the transformer reference, 9 mixers, 4 hybrids
    for model in LT2_MODELS:
        assert {f"lt2-1.3b-{model}", f"tiny-lt2-{model}"} <= names, model


@pytest.mark.parametrize("model", LT2_MODELS)
@torch.no_grad()
def test_tiny_lt2_presets_are_causal_and_decode_like_the_full_forward(model):
    cfg = load_config(f"tiny-lt2-{model}").model
    torch.manual_seed(0)
    net = LoopLM(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 24))
    assert_strictly_causal(net, x, [5, 17], shift=1, vocab=cfg.vocab_size, atol=1e-5)
    assert_decodes_like_full_forward(net, x, [[9, 16, 24], prefill_then_tokens(20, 24)], atol=1e-5)
    reason = assert_static_decodes_like_full_forward(net, x, prefill_then_tokens(20, 24), atol=1e-5)
    assert reason is None or model == "nsa", reason
