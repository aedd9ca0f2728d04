"""Kernel equivalence on CUDA (DESIGN.md invariant 3): every linear mixer run on
flash-linear-attention's Triton kernels agrees with looplm's PyTorch path on the same GPU,
forward, backward and in incremental decoding. Whole looped models on a device are in
``test_models_on_device.py``.

Skipped without a CUDA device and flash-linear-attention (CI has neither); run on a GPU
machine with ``python -m pytest tests/gpu``."""

from __future__ import annotations

import pytest
import torch

from looplm.mixers import MixerConfig, MixerContext
from looplm.model_config import ModelConfig
from looplm.modules.rotary import Rotary
from tests.invariants import error_ratio, prefill_then_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("fla", reason="flash-linear-attention not installed")

#: the mixers that dispatch to fla's kernels (looplm.ops.backend.use_fla)
FLA_KINDS = ["linear_attention", "retnet", "gla", "hgrn2", "mamba2", "deltanet", "gated_deltanet", "kda"]
#: the kinds whose op has a decay gate (fla's gated kernels)
GATED_KINDS = {"retnet", "gla", "hgrn2", "mamba2", "gated_deltanet", "kda"}
#: error ratio allowed between the backends (fla's own tests use the same measure)
RATIO = {torch.float32: 5e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def torch_backend(monkeypatch):
    """A context in which the mixers take the PyTorch path on CUDA too."""
    import contextlib

    from looplm.ops import backend

    @contextlib.contextmanager
    def use():
        with monkeypatch.context() as patch:
            patch.setattr(backend, "fla_installed", lambda: False)
            yield

    return use


CFG = ModelConfig(d_model=256, n_heads=4, layout="1", max_seq_len=4096, bias=False)


def make_layer(kind: str) -> torch.nn.Module:
    return MixerConfig.from_dict({"kind": kind}).build(CFG.block_shape).cuda()


def context(length: int, past: int = 0, batch: int = 2) -> MixerContext:
    """The context of ``length`` new positions after ``past`` cached ones (no padding)."""
    positions = torch.arange(past, past + length, device="cuda").expand(batch, length)
    rope = Rotary(CFG.rotary_dim, CFG.rope_theta).cuda()(positions, torch.float32)
    valid = torch.ones(batch, past + length, dtype=torch.bool, device="cuda")
    return MixerContext(rope=rope, valid=valid, past=past, padded=False)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def on_both_backends(kind: str, dtype: torch.dtype, backward: bool, torch_backend):
    """(fla, PyTorch) results of one 300-position forward of the same layer on the same input,
    each (output, final state, input gradient, parameter gradients)."""
    torch.manual_seed(0)
    layer = make_layer(kind).to(dtype)
    x = torch.randn(2, 300, 256, device="cuda", dtype=dtype)

    def run():
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            out, state = layer(xi, context(x.shape[1]), None)
        if not backward:
            return out, state.recurrent, None, {}
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        return out.detach(), state.recurrent.detach(), xi.grad, grads

    fla_out = run()
    with torch_backend():
        return fla_out, run()


@DTYPES
@pytest.mark.parametrize("kind", FLA_KINDS)
def test_chunked_forward_matches_pytorch(kind, dtype, torch_backend):
    """fla's chunk kernels (inference, 300 positions) against the PyTorch chunkwise form."""
    fla_out, ref_out = on_both_backends(kind, dtype, False, torch_backend)
    assert error_ratio(fla_out[0], ref_out[0]) < RATIO[dtype], "output"
    assert error_ratio(fla_out[1], ref_out[1]) < RATIO[dtype], "final state"


@DTYPES
@pytest.mark.parametrize("kind", FLA_KINDS)
def test_training_forward_and_backward_match_pytorch(kind, dtype, torch_backend):
    from looplm.ops.backend import fla_gated_backward_ok

    op = make_layer(kind).gated_op()
    if op is not None and not fla_gated_backward_ok(torch.device("cuda"), op, dtype):
        pytest.skip("fla's gated backward failed its check on this GPU / Triton (fla #640, looplm.ops.fla_hopper): "
                    "looplm trains this op on PyTorch")
    fla_out, ref_out = on_both_backends(kind, dtype, True, torch_backend)
    tol = RATIO[dtype]
    assert error_ratio(fla_out[0], ref_out[0]) < tol, "output"
    assert error_ratio(fla_out[1], ref_out[1]) < tol, "final state"
    assert error_ratio(fla_out[2], ref_out[2]) < tol, "input gradient"
    assert fla_out[3].keys() == ref_out[3].keys()
    for name in ref_out[3]:
        assert error_ratio(fla_out[3][name], ref_out[3][name]) < 2 * tol, name


@pytest.mark.parametrize("kind", FLA_KINDS)
@torch.no_grad()
def test_decoding_on_fla_matches_full_pytorch_forward(kind, torch_backend):
    """Prefill 100 positions, then 20 single steps on fla's fused recurrent kernels, against
    one full forward on the PyTorch path."""
    torch.manual_seed(0)
    length, prefill = 120, 100
    layer = make_layer(kind)
    x = torch.randn(2, length, 256, device="cuda")
    with torch_backend():
        full, _ = layer(x, context(length), None)
    pieces, state, start = [], None, 0
    for end in prefill_then_tokens(prefill, length):
        out, state = layer(x[:, start:end], context(end - start, past=start), state)
        pieces.append(out)
        start = end
    assert error_ratio(torch.cat(pieces, dim=1), full) < RATIO[torch.float32]


@DTYPES
@pytest.mark.parametrize("kind", sorted(GATED_KINDS))
def test_wide_tiles_pass_the_check_where_fla_refuses_the_gated_backward(kind, dtype):
    """Where fla's own guard refuses its gated backward (Hopper, Triton >= 3.4.0 and < 3.7.1,
    no tilelang), fla's kernels with the scalar-gated dq/dk kernel at 128-wide tiles
    (looplm.ops.fla_hopper) agree with the float32 PyTorch op: output and every gradient, per
    gated op this kind runs. Elsewhere there is nothing to check."""
    from looplm.ops import fla_hopper
    from looplm.ops.backend import fla_guard_allows

    device = torch.device("cuda")
    if fla_guard_allows(device):
        pytest.skip("fla's guard allows the gated backward on this GPU / Triton: fla runs as it ships")
    assert fla_hopper.use_wide_tiles()
    errors = fla_hopper.backward_errors(make_layer(kind).gated_op(), device, dtype)
    assert max(errors.values()) <= fla_hopper.TOLERANCE, errors
