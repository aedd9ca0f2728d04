"""Linear attention, RetNet, GLA, HGRN2 and Mamba2 layers: causality, cache equivalence
(per token and chunked, across chunk boundaries), left padding, states, configs, and
parity with flash-linear-attention's layers (same parameter names, same outputs) — alone
(dense) and inside loops."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from looplm import LoopCache, LoopLM
from looplm.config_base import ConfigError
from looplm.mixers import MixerConfig, MixerContext
from looplm.ops.backend import log_backend
from looplm.mixers.gla import GatedLinearAttention
from looplm.mixers.hgrn2 import HGRN2Attention
from looplm.mixers.linear_attention import DecayState, LinearAttention
from looplm.mixers.mamba2 import Mamba2
from looplm.mixers.retnet import MultiScaleRetention
from looplm.model_config import ModelConfig
from looplm.modules.rotary import Rotary
from tests.conftest import random_ids, tiny_config
from tests.invariants import (
    assert_decodes_like_full_forward,
    assert_strictly_causal,
    prefill_then_tokens,
)

KINDS = ["linear_attention", "retnet", "gla", "hgrn2", "mamba2"]
MIXERS = {  # every kind at its fla defaults, and a variant with the options (short convs, GQA, groups, ...)
    "la": {"kind": "linear_attention"},
    "la-elu-gqa": {"kind": "linear_attention", "feature_map": "elu", "num_kv_heads": 2, "norm_k": True,
                   "chunk_size": 4},
    "retnet": {"kind": "retnet"},
    "retnet-conv-ungated-gqa": {"kind": "retnet", "use_short_conv": True, "use_output_gate": False,
                                "num_kv_heads": 2, "chunk_size": 4},
    "gla": {"kind": "gla"},
    "gla-conv-clamp": {"kind": "gla", "use_short_conv": True, "conv_size": 3, "clamp_min": -2.0, "chunk_size": 4},
    "hgrn2": {"kind": "hgrn2"},
    "hgrn2-conv-ratio": {"kind": "hgrn2", "use_short_conv": True, "expand_ratio": 16, "chunk_size": 4},
    "mamba2": {"kind": "mamba2", "state_size": 16},
    "mamba2-groups": {"kind": "mamba2", "state_size": 8, "head_dim": 8, "n_groups": 2, "D_has_hdim": True,
                      "chunk_size": 4},
}
KIND_NAMES = ["la", "retnet", "gla", "hgrn2", "mamba2"]
LAYOUTS = [("dense", "base", "2"), ("mesh", "mesh", "1+1R3+1"), ("anchor", "anchor", "1+1R3+1")]
# every kind alone and in both loops; each option variant in one loop
GRID = [(f"{m}-{name}", mixer, topo, layout) for m, mixer in MIXERS.items() for name, topo, layout in LAYOUTS
        if m in KIND_NAMES or name == "mesh"]
IDS = [g[0] for g in GRID]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _strengthen(layer: nn.Module) -> None:
    """Unit-scale projections and strong decays, so that every part of a mixer (and any
    mismatch in it) shows in the logits; the model's init makes mixers nearly silent."""
    for module in layer.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=1 / math.sqrt(module.in_features))
    if isinstance(layer, Mamba2):
        layer.dt_bias.data.normal_(0.0, 1.0)


def _model(mixer, topology="base", layout="2") -> LoopLM:
    model = LoopLM(tiny_config(topology, layout=layout, mixer=mixer)).eval()
    for block in model.blocks():
        _strengthen(block.attn)
    return model


@pytest.mark.parametrize("name,mixer,topology,layout", GRID, ids=IDS)
def test_strict_causality(name, mixer, topology, layout):
    assert_strictly_causal(_model(mixer, topology, layout), random_ids(2, 15), (0, 7, 14), shift=5)


@pytest.mark.parametrize("name,mixer,topology,layout", GRID, ids=IDS)
def test_cache_equivalence_per_token_and_chunked(name, mixer, topology, layout):
    splits = [prefill_then_tokens(1, 13), prefill_then_tokens(6, 13), [5, 9, 13]]
    assert_decodes_like_full_forward(_model(mixer, topology, layout), random_ids(3, 13), splits, atol=5e-5)


@pytest.mark.parametrize("name", list(MIXERS))
def test_left_padding_matches_unpadded_rows_and_decodes(name):
    model = _model(MIXERS[name], "mesh", "1+1R3+1")
    short, long_ = random_ids(1, 5, seed=1), random_ids(1, 9, seed=2)
    batch = torch.cat([torch.cat([torch.full((1, 4), 7), short], dim=1), long_])
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    cache = LoopCache()
    out = model(batch, attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(out[0, 4:], model(short).logits[0], atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], model(long_).logits[0], atol=5e-5, rtol=1e-5)
    nxt = random_ids(2, 1, seed=3)
    stepped = model(nxt, cache=cache).logits[:, -1]
    torch.testing.assert_close(stepped[0], model(torch.cat([short, nxt[:1]], 1)).logits[0, -1], atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(stepped[1], model(torch.cat([long_, nxt[1:]], 1)).logits[0, -1], atol=5e-5, rtol=1e-5)


def _ctx(B, T, past=0, valid=None) -> MixerContext:
    valid = torch.ones(B, past + T, dtype=torch.bool) if valid is None else valid
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)[:, past:]
    return MixerContext(rope=Rotary(8, 10000.0)(positions, torch.float32), valid=valid, past=past,
                        padded=not bool(valid.all()))


def _layer(mixer: dict) -> nn.Module:
    layer = MixerConfig.from_dict(mixer).build(ModelConfig(d_model=32, n_heads=4).block_shape)
    _strengthen(layer)
    return layer


@pytest.mark.parametrize("name", list(MIXERS))
def test_layer_chunkwise_training_equals_recurrent_decoding_across_chunks(name):
    """37 positions over chunks of 16 (odd, three chunks): the training form at once, then
    the same positions as a prefill, a chunked continuation and single decoding steps."""
    layer = _layer({**MIXERS[name], "chunk_size": 16})
    x = torch.randn(2, 37, 32)
    full, final = layer(x, _ctx(2, 37))
    out, state = layer(x[:, :10], _ctx(2, 10))
    pieces = [out]
    out, state = layer(x[:, 10:29], _ctx(2, 19, past=10), state)
    pieces.append(out)
    for t in range(29, 37):
        out, state = layer(x[:, t : t + 1], _ctx(2, 1, past=t), state)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(state.recurrent, final.recurrent, atol=5e-5, rtol=1e-4)
    assert state.length == final.length == 37


@pytest.mark.parametrize("name", ["la", "retnet", "gla", "hgrn2", "mamba2"])
def test_layer_gradients_reach_every_parameter(name):
    layer = _layer(MIXERS[name])
    out, _ = layer(torch.randn(2, 9, 32), _ctx(2, 9))
    out.square().mean().backward()
    for pname, param in layer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), pname
        assert param.grad.abs().max() > 0, pname


def test_state_cannot_be_rewound_but_selects_rows():
    layer = _layer(MIXERS["gla-conv-clamp"])
    x = torch.randn(3, 8, 32)
    _, state = layer(x[:, :7], _ctx(3, 7))
    assert isinstance(state, DecayState) and state.crop(7) is state
    with pytest.raises(ValueError, match="cannot be rewound"):
        state.crop(5)
    picked = state.select(torch.tensor([2, 0]))
    out, _ = layer(x[[2, 0], 7:], _ctx(2, 1, past=7), picked)
    ref, _ = layer(x[:, 7:], _ctx(3, 1, past=7), state)
    torch.testing.assert_close(out, ref[[2, 0]])
    model = _model(MIXERS["mamba2"], "anchor", "1+1R3+1")
    cache = LoopCache()
    model(random_ids(2, 6), cache=cache)
    with pytest.raises(ValueError, match="cannot be rewound"):
        cache.crop(4)


def test_retnet_decay_and_hgrn2_tied_gate():
    """RetNet decays head h by γ_h = 1 - 2^(-5-h); HGRN2 writes (1 - α_t) and decays by α_t."""
    retnet = MultiScaleRetention(32, num_heads=4)
    torch.testing.assert_close(retnet.log_gamma.exp(), 1 - 2.0 ** (-5.0 - torch.arange(4.0)))
    hgrn2 = HGRN2Attention(32, num_heads=2, expand_ratio=None)
    assert (hgrn2.num_heads, hgrn2.head_f_dim, hgrn2.head_i_dim) == (2, 16, 16)
    captured = {}
    original = hgrn2.decay

    def spy(q, k, v, log_alpha, scale, initial_state):
        captured.update(k=k, log_alpha=log_alpha)
        return original(q, k, v, log_alpha, scale, initial_state)

    hgrn2.decay = spy
    hgrn2(torch.randn(1, 5, 32), _ctx(1, 5))
    torch.testing.assert_close(captured["k"], 1 - captured["log_alpha"].exp())


def test_builds_from_the_model_and_its_own_fields():
    model = ModelConfig(d_model=64, n_heads=4, n_kv_heads=2)
    la = MixerConfig.from_dict({"kind": "linear_attention"}).build(model.block_shape)
    assert isinstance(la, LinearAttention) and (la.num_heads, la.num_kv_heads, la.head_k_dim) == (4, 2, 16)
    gla = MixerConfig.from_dict({"kind": "gla", "num_heads": 2, "expand_v": 2.0}).build(model.block_shape)
    assert isinstance(gla, GatedLinearAttention) and (gla.num_heads, gla.num_kv_heads) == (2, 2)
    assert (gla.head_k_dim, gla.head_v_dim) == (16, 64)
    retnet = MixerConfig.from_dict({"kind": "retnet"}).build(model.block_shape)
    assert (retnet.head_k_dim, retnet.head_v_dim, retnet.num_kv_heads) == (16, 32, 2)
    hgrn2 = MixerConfig.from_dict({"kind": "hgrn2", "expand_ratio": 32}).build(model.block_shape)
    assert (hgrn2.num_heads, hgrn2.head_f_dim) == (2, 32)
    mamba = MixerConfig.from_dict({"kind": "mamba2", "head_dim": 32, "state_size": 16}).build(model.block_shape)
    assert isinstance(mamba, Mamba2) and (mamba.num_heads, mamba.head_dim, mamba.ssm_state_size) == (4, 32, 16)
    assert MixerConfig.from_dict({"kind": "mamba2"}).build(model.block_shape).head_dim == 32  # 2·64 / n_heads
    for kind in KINDS:  # kind defaults to the registry name and round-trips
        spec = MixerConfig.from_dict({"kind": kind})
        assert spec.kind == kind and MixerConfig.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    "mixer,field",
    [
        ({"kind": "gla", "expand_k": 0.3}, "model.mixer.expand_k"),
        ({"kind": "gla", "gate_logit_normalizer": 0}, "model.mixer.gate_logit_normalizer"),
        ({"kind": "gla", "clamp_min": 1.0}, "model.mixer.clamp_min"),
        ({"kind": "linear_attention", "feature_map": "hedgehog"}, "model.mixer.feature_map"),
        ({"kind": "linear_attention", "num_kv_heads": 3}, "model.mixer.num_kv_heads"),
        ({"kind": "retnet", "conv_size": 0}, "model.mixer.conv_size"),
        ({"kind": "retnet", "chunk_size": 0}, "model.mixer.chunk_size"),
        ({"kind": "hgrn2", "expand_ratio": 5}, "model.mixer.expand_ratio"),
        ({"kind": "hgrn2", "expand_ratio": 8, "num_heads": 4}, "model.mixer.num_heads"),
        ({"kind": "mamba2", "head_dim": 48}, "model.mixer.head_dim"),
        ({"kind": "mamba2", "n_groups": 3}, "model.mixer.n_groups"),
        ({"kind": "mamba2", "A_init_range": [16, 1]}, "model.mixer.A_init_range"),
        ({"kind": "mamba2", "state": 4}, "model.mixer.state"),
    ],
)
def test_config_errors_name_the_field(mixer, field):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({"d_model": 32, "n_heads": 4, "mixer": mixer}, prefix="model")
        MixerConfig.from_dict(mixer).build(ModelConfig(d_model=32, n_heads=4).block_shape)
    assert err.value.field == field


def test_cpu_backend_is_logged(caplog):
    log_backend.cache_clear()
    with caplog.at_level(logging.INFO, logger="looplm"):
        _layer(MIXERS["gla"])(torch.randn(1, 3, 32), _ctx(1, 3))
    assert "mixer gla runs on the torch backend" in caplog.text


# --------------------------------------------------- parity with flash-linear-attention's layers
@pytest.fixture
def fla_torch(monkeypatch):
    """fla's layers with their Triton kernels swapped for fla's own PyTorch references
    (ops, norms, rotary, activations), so that they run on the CPU."""
    pytest.importorskip("fla")
    import fla.layers.gla as fla_gla
    import fla.layers.hgrn2 as fla_hgrn2
    import fla.layers.linear_attn as fla_la
    import fla.layers.mamba2 as fla_mamba2
    import fla.layers.multiscale_retention as fla_retnet
    from fla.modules.rotary import ops as rotary_ops
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    def gla(q, k, v, gk, initial_state=None, output_final_state=False, **_):
        return naive_recurrent_gla(q, k, v, gk, initial_state, output_final_state)

    def linear_attn(q, k, v, initial_state=None, output_final_state=False, normalize=False, scale=None, **_):
        return naive_recurrent_linear_attn(q, k, v, scale, initial_state, output_final_state, normalize)

    def retention(q, k, v, initial_state=None, output_final_state=False, **_):
        H = q.shape[2]
        g = torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float))).expand(*q.shape[:2], H)
        return naive_recurrent_simple_gla(q, k, v, g, None, initial_state, output_final_state)

    def rotary(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, **_):
        T = x.shape[1]
        return rotary_ops.rotary_embedding_ref(x, cos[seqlen_offsets:seqlen_offsets + T],
                                               sin[seqlen_offsets:seqlen_offsets + T], interleaved)

    monkeypatch.setattr(fla_gla, "fused_recurrent_gla", gla)
    monkeypatch.setattr(fla_hgrn2, "fused_recurrent_gla", gla)
    monkeypatch.setattr(fla_hgrn2, "swish", F.silu)
    monkeypatch.setattr(fla_hgrn2, "rms_norm_linear", lambda x, w, b, lw, lb: F.linear(_rms(x, w), lw, lb))
    monkeypatch.setattr(fla_la, "chunk_linear_attn", linear_attn)
    monkeypatch.setattr(fla_la, "fused_recurrent_linear_attn", linear_attn)
    monkeypatch.setattr(fla_retnet, "chunk_retention", retention)
    monkeypatch.setattr(fla_retnet, "fused_recurrent_retention", retention)
    monkeypatch.setattr(rotary_ops, "rotary_embedding", rotary)
    return dict(gla=fla_gla, hgrn2=fla_hgrn2, linear_attention=fla_la, retnet=fla_retnet, mamba2=fla_mamba2)


def _rms(x, weight, eps=1e-5):
    return x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * weight


def _gated_rms(norm):
    from fla.modules.norm.layernorm_gated import rms_norm_ref

    group = getattr(norm, "group_size", None)
    before = getattr(norm, "norm_before_gate", True)
    return lambda x, g, **_: rms_norm_ref(x, norm.weight, None, z=g, eps=norm.eps, group_size=group,
                                          norm_before_gate=before)


def _fla_layer(kind, fla):
    d, H = 32, 4
    if kind == "gla":
        ours = GatedLinearAttention(d, H, num_kv_heads=2, use_short_conv=False)
        theirs = fla["gla"].GatedLinearAttention(hidden_size=d, num_heads=H, num_kv_heads=2)
        theirs.g_norm_swish_gate.forward = _gated_rms(theirs.g_norm_swish_gate)
    elif kind == "hgrn2":
        ours = HGRN2Attention(d, expand_ratio=8)
        theirs = fla["hgrn2"].HGRN2Attention(hidden_size=d, expand_ratio=8)
    elif kind == "linear_attention":
        ours = LinearAttention(d, H)
        theirs = fla["linear_attention"].LinearAttention(hidden_size=d, num_heads=H)
        theirs.norm.forward = lambda x, **_: _rms(x, theirs.norm.weight)
    elif kind == "retnet":
        ours = MultiScaleRetention(d, H, num_kv_heads=2)
        theirs = fla["retnet"].MultiScaleRetention(hidden_size=d, num_heads=H, num_kv_heads=2)
        theirs.g_norm_swish_gate.forward = _gated_rms(theirs.g_norm_swish_gate)
    else:
        ours = Mamba2(d, head_dim=16, state_size=8)
        theirs = fla["mamba2"].Mamba2(hidden_size=d, head_dim=16, state_size=8, chunk_size=4)
        theirs.act = F.silu
        theirs.norm.forward = _gated_rms(theirs.norm)
    return ours, theirs


@pytest.mark.parametrize("kind", KINDS)
def test_same_parameters_and_outputs_as_fla_layer(kind, fla_torch):
    ours, theirs = _fla_layer(kind, fla_torch)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        expected = theirs(x)[0]
    out, _ = ours(x, _ctx(2, 11))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["la", "retnet", "gla", "hgrn2", "mamba2"])
def test_fla_backend_plumbing(name, monkeypatch):
    """The CUDA path, run on the CPU: fla's kernels are replaced by the naive op behind
    their real signatures (every keyword we pass must bind), and the layer must give the
    PyTorch path's outputs for a prefill (chunked kernels) and decoding steps (fused
    recurrent kernels)."""
    pytest.importorskip("fla")
    import inspect

    import fla.ops.gla
    import fla.ops.linear_attn
    import fla.ops.simple_gla

    import looplm.mixers.linear_attention as linear_attention
    from looplm.ops.decay import naive_recurrent_decay

    called = []

    def fake(module, fn_name, gate):
        real = getattr(module, fn_name)

        def run(**kwargs):
            inspect.signature(real).bind(**kwargs)
            assert kwargs.get("normalize", False) is False
            called.append(fn_name)
            return naive_recurrent_decay(kwargs["q"], kwargs["k"], kwargs["v"], kwargs.get(gate), kwargs["scale"],
                                         kwargs["initial_state"], kwargs["output_final_state"])

        monkeypatch.setattr(module, fn_name, run)

    fake(fla.ops.gla, "chunk_gla", "g")
    fake(fla.ops.gla, "fused_recurrent_gla", "gk")
    fake(fla.ops.simple_gla, "chunk_simple_gla", "g")
    fake(fla.ops.simple_gla, "fused_recurrent_simple_gla", "g")
    fake(fla.ops.linear_attn, "chunk_linear_attn", None)
    fake(fla.ops.linear_attn, "fused_recurrent_linear_attn", None)
    layer = _layer(MIXERS[name])
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        expected, _ = layer(x, _ctx(2, 9))
        monkeypatch.setattr(linear_attention, "use_fla", lambda tensor, gated=False: True)
        with torch.enable_grad():
            prefill, state = layer(x[:, :7], _ctx(2, 7))  # training mode: chunked kernel
        pieces = [prefill]
        for t in (7, 8):
            out, state = layer(x[:, t : t + 1], _ctx(2, 1, past=t), state)  # inference: fused recurrent
            pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, 1), expected, atol=2e-5, rtol=1e-4)
    assert called[0].startswith("chunk") and all(c.startswith("fused_recurrent") for c in called[1:]), called
