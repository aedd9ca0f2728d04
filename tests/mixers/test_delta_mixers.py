"""DeltaNet, Gated DeltaNet and KDA layers: causality, cache equivalence (per token and
chunked, across chunk boundaries), left padding, states, configs, fla parity of the
parameters and gates — alone (dense) and inside loops."""

from __future__ import annotations

import logging

import pytest
import torch

from looplm import LoopCache, LoopLM
from looplm.config_base import ConfigError
from looplm.mixers import MixerConfig, MixerContext
from looplm.ops.backend import log_backend
from looplm.mixers.deltanet import DeltaNet, DeltaRuleState
from looplm.mixers.gated_deltanet import GatedDeltaNet
from looplm.mixers.kda import KimiDeltaAttention
from looplm.model_config import ModelConfig
from looplm.modules.rotary import Rotary
from tests.conftest import random_ids, tiny_config
from tests.invariants import (
    assert_decodes_like_full_forward,
    assert_strictly_causal,
    prefill_then_tokens,
)

KINDS = ["deltanet", "gated_deltanet", "kda"]
LAYOUTS = [("dense", "base", "2"), ("mesh", "mesh", "1+1R3+1"), ("anchor", "anchor", "1+1R3+1")]
VARIANTS = {  # the other output norms and options, alone
    "deltanet-gated-negeig": {"kind": "deltanet", "use_gate": True, "allow_neg_eigval": True},
    "gated_deltanet-plain-noconv": {"kind": "gated_deltanet", "use_gate": False, "use_short_conv": False},
    "kda-conv3": {"kind": "kda", "conv_size": 3},
}
GRID = [(f"{kind}-{name}", {"kind": kind}, topo, layout) for kind in KINDS for name, topo, layout in LAYOUTS]
GRID += [(f"{name}-dense", mixer, "base", "2") for name, mixer in VARIANTS.items()]
IDS = [g[0] for g in GRID]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _model(mixer, topology="base", layout="2", **overrides) -> LoopLM:
    model = LoopLM(tiny_config(topology, layout=layout, mixer=mixer, **overrides)).eval()
    for block in model.blocks():  # stronger decays than the init, so decays matter in the checks
        if hasattr(block.attn, "dt_bias"):
            block.attn.dt_bias.data.normal_(0.0, 1.0)
    return model


@pytest.mark.parametrize("name,mixer,topology,layout", GRID, ids=IDS)
def test_strict_causality(name, mixer, topology, layout):
    assert_strictly_causal(_model(mixer, topology, layout), random_ids(2, 15), (0, 7, 14), shift=5)


@pytest.mark.parametrize("name,mixer,topology,layout", GRID, ids=IDS)
def test_cache_equivalence_per_token_and_chunked(name, mixer, topology, layout):
    splits = [prefill_then_tokens(1, 13), prefill_then_tokens(6, 13), [5, 9, 13]]
    assert_decodes_like_full_forward(_model(mixer, topology, layout), random_ids(3, 13), splits, atol=2e-5)


def _ctx(B, T, past=0, valid=None) -> MixerContext:
    valid = torch.ones(B, past + T, dtype=torch.bool) if valid is None else valid
    positions = torch.arange(past, past + T).expand(B, T)
    return MixerContext(rope=Rotary(8, 10000.0)(positions, torch.float32), valid=valid, past=past,
                        padded=not bool(valid.all()))


@pytest.mark.parametrize("kind", KINDS)
def test_layer_prefill_chunks_and_steps_across_chunk_boundaries(kind):
    """chunk_size 16: a 45-position forward spans three chunks; prefill 20 (two chunks from
    an empty state), 17 more from a state, then the recurrent step for the rest."""
    layer = MixerConfig.from_dict({"kind": kind, "chunk_size": 16}).build(ModelConfig(d_model=32, n_heads=4).block_shape)
    if hasattr(layer, "dt_bias"):
        layer.dt_bias.data.normal_(0.0, 1.0)
    x = torch.randn(2, 45, 32)
    full, final = layer(x, _ctx(2, 45))
    pieces, state = [], None
    for a, b in [(0, 20), (20, 37), *[(i, i + 1) for i in range(37, 45)]]:
        out, state = layer(x[:, a:b], _ctx(2, b - a, past=a), state)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.recurrent, final.recurrent, atol=1e-5, rtol=1e-5)
    assert state.length == final.length == 45


@pytest.mark.parametrize("kind", KINDS)
def test_left_padding_matches_unpadded_rows_and_later_steps(kind):
    model = _model({"kind": kind}, "mesh", "1+1R3+1")
    short, long_ = random_ids(1, 5, seed=1), random_ids(1, 9, seed=2)
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], dim=1), long_])
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    cache = LoopCache()
    out = model(batch, attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(out[0, 4:], model(short).logits[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], model(long_).logits[0], atol=2e-5, rtol=1e-5)
    assert torch.isfinite(out).all()
    nxt = random_ids(2, 1, seed=3)
    stepped = model(nxt, cache=cache).logits[:, -1]
    torch.testing.assert_close(stepped[0], model(torch.cat([short, nxt[:1]], 1)).logits[0, -1], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(stepped[1], model(torch.cat([long_, nxt[1:]], 1)).logits[0, -1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_state_cannot_rewind_but_selects_rows(kind):
    model = _model({"kind": kind}, "anchor", "1+1R2+1")
    x = random_ids(3, 10)
    full = model(x).logits
    cache = LoopCache()
    model(x[:, :8], cache=cache)
    state = cache.get("core.0", 1)
    assert isinstance(state, DeltaRuleState) and state.length == 8 and state.crop(8) is state
    with pytest.raises(ValueError, match="cannot be rewound"):
        cache.crop(6)
    cache.select_batch(torch.tensor([2, 0]))
    torch.testing.assert_close(model(x[[2, 0], 8:9], cache=cache).logits[:, 0], full[[2, 0], 8], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_training_path_reaches_every_parameter_and_logs_the_backend(kind, caplog):
    log_backend.cache_clear()
    model = LoopLM(tiny_config("mesh", layout="1+1R2+1", mixer={"kind": kind})).train()
    x = random_ids(2, 20)
    with caplog.at_level(logging.INFO, logger="looplm"):
        loss = model(x[:, :-1], x[:, 1:]).loss
    loss.backward()
    assert f"mixer {kind} runs on the torch backend" in caplog.text
    for name, p in model.named_parameters():
        if ".attn." in name:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_configs_default_to_the_model_shape_and_follow_fla_defaults():
    model = ModelConfig(d_model=32, n_heads=4)
    gdn = MixerConfig.from_dict({"kind": "gated_deltanet"}).build(model.block_shape)
    assert isinstance(gdn, GatedDeltaNet) and (gdn.num_heads, gdn.head_k_dim, gdn.head_v_dim) == (4, 8, 16)
    kda = MixerConfig.from_dict({"kind": "kda", "num_heads": 2, "head_dim": 12}).build(model.block_shape)
    assert isinstance(kda, KimiDeltaAttention) and (kda.num_heads, kda.head_k_dim, kda.head_v_dim) == (2, 12, 12)
    dn = MixerConfig.from_dict({"kind": "deltanet", "expand_v": 2.0}).build(model.block_shape)
    assert isinstance(dn, DeltaNet) and (dn.head_k_dim, dn.head_v_dim) == (8, 16)
    assert MixerConfig.from_dict({"kind": "kda"}).to_dict()["chunk_size"] == 64


@pytest.mark.parametrize(
    "mixer,fragment",
    [({"kind": "gated_deltanet", "chunk_size": 48}, "model.mixer.chunk_size"),
     ({"kind": "kda", "head_dim": 0}, "model.mixer.head_dim"),
     ({"kind": "deltanet", "head_dim": 8}, "unknown key"),
     ({"kind": "deltanet", "conv_size": 0}, "model.mixer.conv_size")],
)
def test_config_errors_at_load(mixer, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ModelConfig.from_dict({"mixer": mixer}, prefix="model")


@pytest.mark.parametrize(
    "mixer,fragment",
    [({"kind": "gated_deltanet", "num_heads": 3}, "model.mixer.num_heads"),
     ({"kind": "deltanet", "expand_k": 0.3}, "model.mixer.expand_k"),
     ({"kind": "kda", "expand_v": 0.3}, "model.mixer.expand_v")],
)
def test_config_errors_against_the_model_shape(mixer, fragment):
    with pytest.raises(ConfigError, match=fragment):
        LoopLM(tiny_config("base", layout="1", mixer=mixer))


# ------------------------------------------------------------- flash-linear-attention
def _fla_pairs():
    layers = pytest.importorskip("fla.layers", reason="flash-linear-attention not installed")
    return [
        (layers.DeltaNet(hidden_size=32, num_heads=4), DeltaNet(32, 4)),
        (layers.DeltaNet(hidden_size=32, num_heads=4, use_gate=True), DeltaNet(32, 4, use_gate=True)),
        (layers.GatedDeltaNet(hidden_size=32, num_heads=4, head_dim=8), GatedDeltaNet(32, 4, 8)),
        (layers.GatedDeltaNet(hidden_size=32, num_heads=2, head_dim=8, use_gate=False, expand_v=1),
         GatedDeltaNet(32, 2, 8, expand_v=1, use_gate=False)),
        (layers.KimiDeltaAttention(hidden_size=32, num_heads=4, head_dim=8), KimiDeltaAttention(32, 4, 8)),
    ]


def test_parameters_are_fla_layers_parameters():
    """Same names and shapes: fla's state dict loads strictly into the looplm layer."""
    for theirs, ours in _fla_pairs():
        ours.load_state_dict(theirs.state_dict(), strict=True)
        shapes = {k: v.shape for k, v in ours.state_dict().items()}
        assert {k: v.shape for k, v in theirs.state_dict().items()} == shapes


def test_decays_match_fla_gates():
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.kda.gate import naive_kda_gate

    x = torch.randn(2, 7, 32)
    for theirs, ours in _fla_pairs()[2:]:
        ours.load_state_dict(theirs.state_dict())
        if isinstance(ours, KimiDeltaAttention):
            want = naive_kda_gate(theirs.f_proj(x).view(2, 7, 4, 8), theirs.A_log, theirs.dt_bias)
        else:
            want = naive_gdn_gate(theirs.a_proj(x), theirs.A_log, theirs.dt_bias)
        torch.testing.assert_close(ours.log_decay(x), want)
