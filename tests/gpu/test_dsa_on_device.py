"""DSA's split at position top_k on a device (issue 30): the dense queries through SDPA (flash
attention on CUDA), the later ones through the Triton selected-key kernel, forward, indexer
loss and backward against the CPU float32 definition; a decoding step past top_k against
the definition; and a dense prefill that keeps no [S, S] scores. The CPU cases check the
test bodies (and the PyTorch path) in CI; the CUDA ones run where a device is lent
(``bash benchmarks/gpu.sh``)."""

from __future__ import annotations

import pytest
import torch

from looplm.ops.sparse import dsa_attention
from tests.ops.test_dsa import _inputs, _reference

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
#: bf16 inputs against the float32 definition; float32 on CUDA within kernel rounding
TOL = {torch.float32: {"atol": 2e-4, "rtol": 2e-4}, torch.bfloat16: {"atol": 4e-2, "rtol": 4e-2}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_dsa_split_on_device_equals_the_cpu_definition(device, dtype, padded):
    """150 queries: 64 under top_k (one SDPA call), 86 past it in blocks of 32 (index scores,
    top-k, the selected-key kernel on CUDA), output, loss and the six inputs' gradients."""
    B, Hkv, G, T, top_k = 2, 2, 2, 150, 64
    tensors, valid = _inputs(B, Hkv, G, T, T, D=32, DI=32, padded=padded)
    o_ref, loss_ref = _reference(*tensors, valid, top_k, 32**-0.5)
    weights = torch.linspace(-1, 1, o_ref.shape[-1])
    refs = torch.autograd.grad((o_ref * weights).sum() + loss_ref, tensors)
    on_device = [t.detach().to(device, dtype if i < 3 else torch.float32).requires_grad_(True)
                 for i, t in enumerate(tensors)]  # q, k, v in dtype; the indexer in float32
    o, loss = dsa_attention(*on_device, None if valid is None else valid.to(device), top_k=top_k, scale=32**-0.5,
                            index_loss=True, block=32)
    grads = torch.autograd.grad((o.float() * weights.to(device)).sum() + loss, on_device)
    assert o.dtype == dtype
    torch.testing.assert_close(o.float().cpu(), o_ref, **TOL[dtype])
    torch.testing.assert_close(loss.cpu(), loss_ref, **TOL[dtype])
    for name, a, b in zip(["q", "k", "v", "q_index", "k_index", "w_index"], grads, refs):
        torch.testing.assert_close(a.float().cpu(), b, **TOL[dtype], msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_dsa_decoding_step_on_device_equals_the_cpu_definition(device, dtype, padded):
    """One decoding query past top_k (the step ``generate`` runs): one top-k over the row and
    the grouped query heads folded over the k picks (one MHA-shaped SDPA call, masked where
    a padded row has fewer candidates than k), against the CPU float32 definition."""
    B, Hkv, G, S, top_k = 2, 2, 4, 150, 64
    tensors, valid = _inputs(B, Hkv, G, 1, S, D=32, DI=32, padded=padded)
    o_ref, _ = _reference(*tensors, valid, top_k, 32**-0.5)
    on_device = [t.detach().to(device, dtype if i < 3 else torch.float32) for i, t in enumerate(tensors)]
    o, _ = dsa_attention(*on_device, None if valid is None else valid.to(device), top_k=top_k, scale=32**-0.5)
    assert o.dtype == dtype and o.shape == o_ref.shape
    torch.testing.assert_close(o.float().cpu(), o_ref, **TOL[dtype])


@CUDA
@torch.no_grad()
def test_dense_prefill_on_cuda_keeps_no_score_matrix():
    """LT2 0.6B's prefill shape per layer (S = top_k = 2048, 16 heads of 64, bf16, batch 8):
    the peak memory of DSA's attention is far below one [B, H, S, S] score tensor."""
    B, H, S, D = 8, 16, 2048, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, 1, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k_index = torch.randn(B, S, 128, device="cuda", generator=g)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o, _ = dsa_attention(q, k, v, None, k_index, None, None, top_k=S, scale=D**-0.5)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert o.shape == q.shape
    assert peak < B * H * S * S * 2 / 16, f"{peak / 2**20:.0f} MiB"
