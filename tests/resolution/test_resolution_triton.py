"""SpiralFormer's self-aggregation and allocation router as Triton kernels
(:mod:`looplm.ops.resolution_triton`, issue 25) equal the PyTorch operators: z, ũ and every
gradient alone, for any chunk size, offset, shift and width; logits and gradients in every
multi-resolution model of tests/resolution/test_reshape_path.py; decoding through them
equals the full forward; they trace whole; and a compressed iteration launches 6 operators
on top of a full one. Runs on CUDA when there is one, else on CPU under
``TRITON_INTERPRET=1`` in a child process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from looplm import LoopLM  # noqa: E402
from looplm.config_base import ConfigError  # noqa: E402
from looplm.model_config import ModelConfig  # noqa: E402
from looplm.resolution import (  # noqa: E402
    AllocationRouter, MeanPool, MultiResolution, SelfAggregation, UniformBroadcast,
)
from looplm.resolution.downscale import chunk_grid  # noqa: E402
from tests.conftest import random_ids, tiny_config  # noqa: E402
from tests.invariants import assert_decodes_like_full_forward, prefill_then_tokens  # noqa: E402
from tests.resolution.test_reshape_path import CASES, IDS, _model, _step_count  # noqa: E402
from tests.triton_kernels import DEVICE, reruns_interpreted, run_interpreted, runs_kernels  # noqa: E402


#: hypothesis examples per operator test: fewer on a GPU, where every new chunk size, width
#: and kind compiles a kernel (benchmarks/gpu.sh gives all GPU tests one minute)
EXAMPLES = 10 if DEVICE == "cpu" else 6


@reruns_interpreted
def test_kernels_equal_the_reference_under_the_triton_interpreter():
    run_interpreted(__file__, skipped=2)  # this test and the bfloat16 one


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module.to(DEVICE)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int) -> tuple[torch.Tensor, ...]:
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    return torch.autograd.grad((out * weights).sum(), inputs)


def assert_same_values_and_gradients(got: torch.Tensor, want: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """``got`` equals ``want`` and so do the gradients of a weighted sum of each with respect
    to ``inputs``, within float32 rounding (relative to each gradient's largest entry)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(_grads(got, inputs, seed=1), _grads(want, inputs, seed=1), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(b.abs().max().item(), 1.0))


def _shifted(grid: torch.Tensor, front: int, skip: int, length: int) -> torch.Tensor:
    """What MultiResolution.up makes of S↑'s [B, m·g, d] grid: crop ``skip`` slots, pad
    ``front`` zero rows, crop to ``length`` (Eq. 22)."""
    rows = grid[:, skip:]
    return F.pad(rows, (0, 0, front, length - front - rows.shape[1]))


@runs_kernels
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(B=st.integers(1, 3), g=st.integers(2, 9), d=st.integers(1, 70), learned=st.booleans(), data=st.data())
def test_down_scaling_equals_the_reference(B, g, d, learned, data):
    """Self-aggregation and the mean, any batch, chunk size, width, lead (chunk 0's empty
    slots) and trailing tokens after the last complete chunk: z and the gradients of the
    tokens (zero for the trailing ones), the scorer's weight and bias within float32 rounding."""
    lead = data.draw(st.integers(0, g - 1), "lead")
    L = data.draw(st.integers(max(1, g - lead), 5 * g), "length")
    n = (L + lead) // g
    op = _randomised(SelfAggregation(d) if learned else MeanPool(), seed=d)
    tokens = torch.randn(B, L, d, generator=torch.Generator().manual_seed(L)).to(DEVICE).requires_grad_()
    want = op(chunk_grid(tokens, lead, n, g), lead)
    got = op.fused(tokens, lead, n, g)
    assert_same_values_and_gradients(got, want, [tokens, *op.parameters()])


@runs_kernels
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(B=st.integers(1, 3), g=st.integers(2, 9), d=st.integers(1, 70), m=st.integers(1, 5), learned=st.booleans(),
       data=st.data())
def test_up_scaling_equals_the_reference(B, g, d, m, learned, data):
    """The allocation router and the uniform broadcast, any batch, chunk size, width and
    placement (zero rows before the shift, slots read by no new position, slots after the
    last one): ũ and the gradients of the latents, the router's weights and biases within
    float32 rounding."""
    skip = data.draw(st.integers(0, g - 1), "skip")
    front = data.draw(st.integers(0, 2 * g), "front")
    length = front + data.draw(st.integers(1, m * g - skip), "rows read")
    op = _randomised(AllocationRouter(d, g) if learned else UniformBroadcast(g), seed=g)
    z = torch.randn(B, m, d, generator=torch.Generator().manual_seed(m)).to(DEVICE).requires_grad_()
    want = _shifted(op(z).reshape(B, m * g, d), front, skip, length)
    got = op.fused(z, front, skip, length)
    assert_same_values_and_gradients(got, want, [z, *op.parameters()])


@runs_kernels
def test_latents_read_through_a_slice():
    """Decoding reads the latest chunks only (``latents[:, j0:]``, not contiguous over the
    batch): the kernel reads the view's strides."""
    op = _randomised(AllocationRouter(6, 4), seed=3)
    latents = torch.randn(2, 5, 6, device=DEVICE)
    read = latents[:, 3:]
    torch.testing.assert_close(op.fused(read, 0, 2, 5), _shifted(op(read).reshape(2, 8, 6), 0, 2, 5))


def _on_kernel(model: LoopLM, kernel: str) -> LoopLM:
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, MultiResolution):
            m.kernel = kernel
    return model


@runs_kernels
@pytest.mark.parametrize("name", IDS)
@pytest.mark.parametrize("length", [5, 40])
def test_models_equal_the_reference_forward_and_backward(name, length):
    """Every multi-resolution configuration (learned and fixed operators, offsets, shifts,
    odd chunks, an unshared L-shape) at a length where few chunks complete (none at g = 8
    with ω = 0) and one where many do."""
    reference = _model(name).to(DEVICE)
    fused = _on_kernel(reference, "triton")
    vocab = reference.cfg.vocab_size
    x, y = (random_ids(2, length, vocab=vocab, seed=length + i).to(DEVICE) for i in (0, 1))
    ref, out = reference(x, y), fused(x, y)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    ref.loss.backward()
    out.loss.backward()
    for (key, p), q in zip(fused.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.abs().sum(), key
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


@runs_kernels
@pytest.mark.parametrize("name", ["spiralformer-b-tiny", "parallel", "odd-chunks"])
def test_cache_decoding_equals_full_forward(name):
    """Prefill, token by token and chunked prefill through the kernels (pending tokens of the
    current chunk, latents read through a slice): the logits of one full forward."""
    model = _on_kernel(_model(name), "triton").eval().to(DEVICE)
    x = random_ids(2, 26, vocab=model.cfg.vocab_size, seed=7).to(DEVICE)
    with torch.no_grad():
        assert_decodes_like_full_forward(model, x, [prefill_then_tokens(5, 26), [3, 4, 13, 17, 26]], atol=2e-5)


@runs_kernels
def test_traces_as_one_graph():
    """Both kernels are custom operators Dynamo keeps whole (``fullgraph``): a compiled
    down-core-up round trip and its backward equal eager."""
    agg, router = _randomised(SelfAggregation(8), seed=6), _randomised(AllocationRouter(8, 4), seed=7)
    tokens = torch.randn(2, 14, 8, device=DEVICE, requires_grad=True)

    def round_trip(tokens):
        z = agg.fused(tokens, 2, 4, 4)
        return router.fused(torch.tanh(z), 3, 2, 14).square().sum()

    compiled = torch.compile(round_trip, backend="aot_eager", fullgraph=True)
    want, got = round_trip(tokens), compiled(tokens)
    torch.testing.assert_close(got, want)
    inputs = [tokens, *agg.parameters(), *router.parameters()]
    for a, b in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs), strict=True):
        torch.testing.assert_close(a, b)


@runs_kernels
def test_autocast_leaves_the_kernels_in_the_state_dtype():
    """Under bf16 autocast the kernels read the fp32 state as it is and compute in float32:
    their outputs are float32 and equal the run without autocast."""
    agg, router = _randomised(SelfAggregation(8), seed=4), _randomised(AllocationRouter(8, 4), seed=5)
    tokens, z = torch.randn(2, 11, 8, device=DEVICE), torch.randn(2, 3, 8, device=DEVICE)
    want = agg.fused(tokens, 2, 3, 4), router.fused(z, 3, 2, 9)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = agg.fused(tokens, 2, 3, 4), router.fused(z, 3, 2, 9)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and torch.equal(a, b)


#: operators a compressed iteration adds to a full one on the CUDA path, forward + backward:
#: aggregate and allocate (one kernel each way) and the two weight-gradient sums (4 for the
#: mean and the uniform broadcast, which have no weights). The PyTorch operators add 32
#: (tests/resolution/test_reshape_path.py).
FUSED_OVERHEAD = 6


@runs_kernels
def test_a_compressed_iteration_launches_six_operators_more_than_a_full_one():
    """Issue 25's SpiralFormer-B against its full-resolution loop, as a GPU runs them (MeSH's
    write-read and the resolution operators on their kernels): 3 compressed iterations add
    3 × 6 operators (1.05 × at d = 64; 1.24 × before), and no host syncs."""
    from tests.resolution.test_reshape_path import _benchmark_variants

    variants = _benchmark_variants()
    on_kernels = {"topology": {"kind": "mesh", "kernel": "triton"}}
    spiral = _step_count({**variants["spiral"], **on_kernels, "resolution": {
        **variants["spiral"]["resolution"], "kernel": "triton"}}, DEVICE, length=32)
    full = _step_count({**variants["spiral-full"], **on_kernels}, DEVICE, length=32)
    extra = spiral.by_op.copy()
    extra.subtract(full.by_op)
    detail = f"spiral {spiral}; full {full}; extra {dict(+extra)}"
    assert spiral.syncs == 0 and full.syncs == 0, detail
    for op in ("chunk_aggregate", "chunk_aggregate_backward", "chunk_allocate", "chunk_allocate_backward"):
        assert spiral.by_op[f"looplm.{op}"] == 3, detail
    assert spiral.ops - full.ops <= 3 * FUSED_OVERHEAD, detail
    fixed = _step_count({**variants["spiral"], **on_kernels, "resolution": {
        "down": "mean", "up": "uniform", "kernel": "triton"}}, DEVICE, length=32)
    assert fixed.ops - full.ops <= 3 * 4, f"mean/uniform {fixed}; full {full}"  # no parameters: no sums


@runs_kernels
def test_a_tile_too_large_for_a_program_stays_on_pytorch(monkeypatch):
    """Chunk × width tiles over ``MAX_TILE`` run the PyTorch operators (same logits)."""
    from looplm.accounting.dispatch import count_dispatch
    from looplm.ops import resolution_triton

    model = _on_kernel(_model("spiralformer-b-tiny"), "triton").to(DEVICE)
    x = random_ids(1, 16, vocab=model.cfg.vocab_size).to(DEVICE)
    want = model(x).logits
    monkeypatch.setattr(resolution_triton, "MAX_TILE", 16)
    counts, got = count_dispatch(lambda: model(x).logits)
    assert not [op for op in counts.by_op if op.startswith("looplm.chunk_")], counts.by_op
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA only: bfloat16 storage through the interpreter is not the GPU's")
def test_bfloat16_model_is_close_to_the_float32_reference():
    """A bf16 model: the kernels read and write bf16 and compute in float32 (the PyTorch
    operators compute in bf16): both within bf16 rounding of the float32 model."""
    exact = _on_kernel(_model("spiralformer-b-tiny"), "torch").to(DEVICE)
    fused = _on_kernel(exact, "triton").bfloat16()
    ids = random_ids(2, 24, vocab=exact.cfg.vocab_size).to(DEVICE)
    want, got = exact(ids).logits, fused(ids).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2)


def test_kernel_setting_is_checked():
    cfg = CASES["spiralformer-b-tiny"]
    with pytest.raises(ConfigError, match=r"model\.resolution\.kernel.*'cuda'.*auto, torch, triton"):
        ModelConfig.from_dict({**cfg.to_dict(), "resolution": {**cfg.resolution.to_dict(), "kernel": "cuda"}})
    assert LoopLM(tiny_config("mesh", layout="1+1x{1/2,1}+1")).resolution.kernel == "auto"
