"""The delta-rule mixers' decoding step (``DeltaRuleMixer.step``): equal to the full
forward for every variant, with and without autograd (cached fused weights without),
following parameter updates, as one traced graph. Its operator counts:
``test_decode_counts.py``."""

from __future__ import annotations

import pytest
import torch

from looplm.mixers import MixerConfig, MixerContext
from looplm.model_config import ModelConfig

CFG = ModelConfig(d_model=32, n_heads=2, layout="1", max_seq_len=64, bias=False)
VARIANTS = {
    "deltanet": {"kind": "deltanet"},
    "deltanet-gated-negeig-convbias": {"kind": "deltanet", "use_gate": True, "allow_neg_eigval": True,
                                       "conv_bias": True},
    "deltanet-nobeta-noconv": {"kind": "deltanet", "use_beta": False, "use_short_conv": False},
    "gated_deltanet": {"kind": "gated_deltanet"},
    "gated_deltanet-plain-noconv-negeig": {"kind": "gated_deltanet", "use_gate": False, "use_short_conv": False,
                                           "allow_neg_eigval": True},
    "kda": {"kind": "kda"},
    "kda-conv2": {"kind": "kda", "conv_size": 2},
}


def _ctx(B: int, T: int, past: int, valid: torch.Tensor | None = None) -> MixerContext:
    valid = torch.ones(B, past + T, dtype=torch.bool) if valid is None else valid[:, : past + T]
    rope = (torch.zeros(B, T, 2), torch.zeros(B, T, 2))  # the linear mixers take no rotary
    return MixerContext(rope=rope, valid=valid, past=past, padded=not bool(valid.all()))


def _layer(mixer: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = MixerConfig.from_dict(mixer).build(CFG.block_shape)
    with torch.no_grad():  # stronger decays and non-trivial biases than the init, so they matter
        for name, p in layer.named_parameters():
            if name in ("dt_bias",) or name.endswith("conv1d.bias"):
                p.normal_(0.0, 1.0)
    return layer


def _decode(layer, x: torch.Tensor, prefill: int, valid: torch.Tensor | None = None,
            ends: list[int] | None = None) -> torch.Tensor:
    """Outputs of a prefill of ``prefill`` positions, then pieces ending at ``ends`` (default:
    one position at a time)."""
    B, T, _ = x.shape
    out, state = layer(x[:, :prefill], _ctx(B, prefill, 0, valid))
    pieces, start = [out], prefill
    for end in ends or range(prefill + 1, T + 1):
        out, state = layer(x[:, start:end], _ctx(B, end - start, start, valid), state)
        pieces.append(out)
        start = end
    assert state.length == T and state.recurrent.shape == (B, layer.num_heads, layer.head_k_dim, layer.head_v_dim)
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad-cached", "grad"])
@pytest.mark.parametrize("name", VARIANTS)
def test_step_equals_full_forward(name, grad):
    layer = _layer(VARIANTS[name])
    x = torch.randn(3, 11, CFG.d_model)
    with torch.set_grad_enabled(grad):
        full, _ = layer(x, _ctx(3, 11, 0))
        stepped = _decode(layer, x, prefill=4)
    torch.testing.assert_close(stepped, full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", VARIANTS)
def test_steps_and_chunks_share_the_state_layout(name):
    """Steps write the fused state that a later chunk (the chunkwise path) reads, and back."""
    layer = _layer(VARIANTS[name])
    x = torch.randn(2, 14, CFG.d_model)
    with torch.no_grad():
        full, _ = layer(x, _ctx(2, 14, 0))
        mixed = _decode(layer, x, prefill=3, ends=[4, 5, 9, 10, 11, 14])
    torch.testing.assert_close(mixed, full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["deltanet-gated-negeig-convbias", "gated_deltanet", "kda"])
def test_step_with_left_padding_equals_unpadded_rows(name):
    layer = _layer(VARIANTS[name])
    x = torch.randn(2, 10, CFG.d_model)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[0, :3] = False
    with torch.no_grad():
        stepped = _decode(layer, x, prefill=5, valid=valid)
        alone, _ = layer(x[:1, 3:], _ctx(1, 7, 0))
        full, _ = layer(x[1:], _ctx(1, 10, 0))
    torch.testing.assert_close(stepped[0, 3:], alone[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(stepped[1], full[0], atol=2e-5, rtol=1e-5)


def test_cached_fused_weights_follow_in_place_updates_and_loaded_checkpoints():
    layer = _layer(VARIANTS["gated_deltanet"])
    x = torch.randn(2, 6, CFG.d_model)
    donor = _layer(VARIANTS["gated_deltanet"])
    with torch.no_grad():
        for p in donor.parameters():
            p.mul_(1.5)
        _decode(layer, x, prefill=3)  # fills the cache
        for name, p in layer.named_parameters():  # an optimizer's step: in place
            p.add_(0.1 * torch.randn_like(p))
        torch.testing.assert_close(_decode(layer, x, prefill=3), layer(x, _ctx(2, 6, 0))[0], atol=2e-5, rtol=1e-5)
        layer.load_state_dict(donor.state_dict())
        torch.testing.assert_close(_decode(layer, x, prefill=3), donor(x, _ctx(2, 6, 0))[0], atol=2e-5, rtol=1e-5)
    assert set(layer.state_dict()) == set(donor.state_dict())  # the fused weights are not in checkpoints
    assert {"q_proj.weight", "a_proj.weight", "b_proj.weight", "g_proj.weight", "q_conv1d.weight"} <= set(
        layer.state_dict())


@pytest.mark.parametrize("name", ["deltanet-gated-negeig-convbias", "gated_deltanet", "kda"])
def test_step_traces_as_one_graph(name):
    """The step compiles with fullgraph=True (no graph break: the fused weights come from the
    prefill's cache, unchecked while tracing) and gives the eager step's outputs."""
    torch._dynamo.reset()
    layer = _layer(VARIANTS[name]).eval()
    x = torch.randn(2, 9, CFG.d_model)
    step = torch.compile(lambda xi, ctx, st: layer(xi, ctx, st), fullgraph=True, backend="eager")
    with torch.no_grad():
        full, _ = layer(x, _ctx(2, 9, 0))
        out, state = layer(x[:, :8], _ctx(2, 8, 0))
        stepped, _ = step(x[:, 8:], _ctx(2, 1, 8), state)
    torch.testing.assert_close(stepped, full[:, 8:], atol=2e-5, rtol=1e-5)


def test_training_keeps_no_cached_copy_of_the_weights():
    layer = _layer(VARIANTS["gated_deltanet"])
    x = torch.randn(2, 6, CFG.d_model)
    with torch.no_grad():
        layer(x, _ctx(2, 6, 0))  # an evaluation forward fills the cache
    assert layer._derived is not None
    _, state = layer(x[:, :5], _ctx(2, 5, 0))
    layer(x[:, 5:], _ctx(2, 1, 5), state)[0].sum().backward()  # a step under autograd
    assert layer._derived is None and layer.q_proj.weight.grad is not None and layer.a_proj.weight.grad is not None
