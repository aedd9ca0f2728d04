"""Kernel equivalence on CUDA (DESIGN.md invariant 3): every linear mixer run on
flash-linear-attention's Triton kernels agrees with looplm's PyTorch path on the same GPU,
forward, backward and in incremental decoding; whole looped models keep cache
equivalence on the fla backend, train in bf16 and compile.

Skipped without a CUDA device and flash-linear-attention (CI has neither); run on a GPU
machine with ``python -m pytest tests/gpu``."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopCache, LoopLM
from looplm.mixers import MixerConfig, MixerContext
from looplm.model_config import ModelConfig
from looplm.modules.rotary import Rotary
from tests.conftest import tiny_config
from tests.invariants import assert_decodes_like_full_forward, prefill_then_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("fla", reason="flash-linear-attention not installed")

#: the mixers that dispatch to fla's kernels (looplm.mixers.backend.use_fla)
FLA_KINDS = ["linear_attention", "retnet", "gla", "hgrn2", "mamba2", "deltanet", "gated_deltanet", "kda"]
#: the kinds whose op has a decay gate (fla's gated kernels)
GATED_KINDS = {"retnet", "gla", "hgrn2", "mamba2", "gated_deltanet", "kda"}
#: error ratio ‖a − b‖ / ‖b‖ allowed between the backends (fla's own tests use the same measure)
RATIO = {torch.float32: 5e-3, torch.bfloat16: 2e-2}


def error_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).pow(2).mean().sqrt()
    return (diff / expected.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


@pytest.fixture
def torch_backend(monkeypatch):
    """A context in which the mixers take the PyTorch path on CUDA too."""
    import contextlib

    import looplm.mixers.backend as backend

    @contextlib.contextmanager
    def use():
        with monkeypatch.context() as patch:
            patch.setattr(backend, "fla_installed", lambda: False)
            yield

    return use


CFG = ModelConfig(d_model=256, n_heads=4, layout="1", max_seq_len=4096, bias=False)


def make_layer(kind: str) -> torch.nn.Module:
    return MixerConfig.from_dict({"kind": kind}).build(CFG).cuda()


def context(length: int, past: int = 0, batch: int = 2) -> MixerContext:
    """The context of ``length`` new positions after ``past`` cached ones (no padding)."""
    positions = torch.arange(past, past + length, device="cuda").expand(batch, length)
    rope = Rotary(CFG.rotary_dim, CFG.rope_theta).cuda()(positions, torch.float32)
    valid = torch.ones(batch, past + length, dtype=torch.bool, device="cuda")
    return MixerContext(rope=rope, valid=valid, past=past, padded=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", FLA_KINDS)
def test_forward_and_backward_match_pytorch(kind, dtype, torch_backend):
    from looplm.mixers.backend import fla_gated_backward_ok

    if kind in GATED_KINDS and not fla_gated_backward_ok(torch.device("cuda")):
        pytest.skip("fla refuses the gated backward on this GPU / Triton (fla #640): looplm trains these on PyTorch")
    torch.manual_seed(0)
    layer = make_layer(kind).to(dtype)
    x = torch.randn(2, 300, 256, device="cuda", dtype=dtype)

    def run():
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out, state = layer(xi, context(300), None)
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        return out.detach(), state.recurrent.detach(), xi.grad, grads

    fla_out = run()
    with torch_backend():
        ref_out = run()
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


@pytest.mark.parametrize("kind", FLA_KINDS + ["attention", "sliding_window", "nsa", "dsa"])
@torch.no_grad()
def test_looped_model_cache_equivalence_on_cuda(kind):
    """A looped model (anchor topology) decodes like its full forward with every mixer on the
    GPU backend, so the per-(block, iteration) states are right on fla's kernels too."""
    options = {"sliding_window": {"window": 8}, "nsa": {"block_size": 4, "select_blocks": 2, "window": 8},
               "dsa": {"top_k": 8, "index_heads": 2, "index_head_dim": 16}}.get(kind, {})
    torch.manual_seed(0)
    cfg = tiny_config("anchor", layout="1+1R3+1", d_model=128, n_heads=4, mixer={"kind": kind, **options})
    model = LoopLM(cfg).cuda().eval()
    x = torch.randint(0, cfg.vocab_size, (2, 40), device="cuda")
    full = model(x).logits
    cache, pieces, start = LoopCache(), [], 0
    for end in prefill_then_tokens(30, 40):
        pieces.append(model(x[:, start:end], cache=cache).logits)
        start = end
    assert error_ratio(torch.cat(pieces, dim=1), full) < RATIO[torch.float32]


@pytest.mark.parametrize("kind", ["attention", "gated_deltanet"])
def test_bf16_autocast_training_step_reduces_loss(kind):
    torch.manual_seed(0)
    cfg = tiny_config("mesh", layout="1+1R2+1", d_model=128, n_heads=4, mixer={"kind": kind})
    model = LoopLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    x = torch.randint(0, cfg.vocab_size, (4, 64), device="cuda")
    losses = []
    for _ in range(30):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, targets=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]


def test_compiled_looped_model_matches_eager():
    torch.manual_seed(0)
    cfg = tiny_config("mesh", layout="1+1R3+1", d_model=128, n_heads=4)
    model = LoopLM(cfg).cuda()
    x = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
    eager = model(x, targets=x)
    compiled = torch.compile(model)(x, targets=x)
    assert error_ratio(compiled.logits, eager.logits) < 1e-4
    compiled.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_decode_after_chunked_prefill_whole_model_uses_fla():
    """The full model on fla agrees with itself decoded (prefill 17, chunks of 5, steps)."""
    torch.manual_seed(0)
    cfg = tiny_config("gated_residual", layout="5R2", d_model=128, n_heads=4, mixer={"kind": "gated_deltanet"},
                      hybrid={"mixer": {"kind": "attention"}, "ratio": "4:1"})
    model = LoopLM(cfg).cuda().eval()
    x = torch.randint(0, cfg.vocab_size, (2, 33), device="cuda")
    with torch.no_grad():
        assert_decodes_like_full_forward(model, x, [[17, 22, 27, 33], prefill_then_tokens(25, 33)], atol=2e-3,
                                         rtol=2e-3)
