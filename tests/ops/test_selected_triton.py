"""The Triton selected-key attention (DSA's prefill and training kernel) equals the PyTorch
reference forward and backward: alone against ``gathered_attention`` and the dense masked
attention, inside ``dsa_attention`` (padding, query blocks, the indexer loss and its
gradient), and in a model. Runs on CUDA when there is one, else on CPU under
``TRITON_INTERPRET=1`` in a child process (the interpreter must be chosen before triton
compiles anything, so it cannot be switched on inside this process)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from looplm import LoopLM  # noqa: E402
from looplm.ops.sparse import dsa_attention, gathered_attention, grouped_attention, topk_indices, topk_mask  # noqa: E402
from tests.conftest import random_ids, tiny_config  # noqa: E402
from tests.triton_kernels import DEVICE, reruns_interpreted, run_interpreted, runs_kernels  # noqa: E402

TOL = {"atol": 2e-5, "rtol": 2e-5}


@reruns_interpreted
def test_kernels_equal_the_reference_under_the_triton_interpreter():
    run_interpreted(__file__, skipped=2)  # this test and the bfloat16 one


def _inputs(B, Hkv, G, T, S, D, DV, width, dtype, seed, fillers=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv, G, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, S, DV, generator=g, dtype=dtype)
    scores = torch.randn(B, T, S, generator=g)
    if fillers:
        scores[0, min(1, T - 1)] = float("-inf")  # a row with nothing allowed: zeros
        scores[-1, T - 1, :] = float("-inf")
        scores[-1, T - 1, S // 2] = 0.5  # a row with fewer keys than width
    q, k, v = (x.to(DEVICE).requires_grad_(True) for x in (q, k, v))
    return q, k, v, scores.to(DEVICE)


@runs_kernels
@pytest.mark.parametrize(
    "B, Hkv, G, T, S, D, DV, width, fillers",
    [(2, 2, 3, 5, 40, 8, 8, 6, True), (1, 1, 1, 7, 70, 16, 16, 33, True), (2, 3, 2, 4, 50, 12, 20, 40, False),
     (1, 2, 4, 3, 9, 8, 8, 9, True)],
)
def test_selected_attention_equals_gathered_attention_forward_and_backward(B, Hkv, G, T, S, D, DV, width, fillers):
    from looplm.ops.sparse.selected_triton import selected_attention

    q, k, v, scores = _inputs(B, Hkv, G, T, S, D, DV, width, torch.float32, seed=B + T + width, fillers=fillers)
    index, keep = topk_indices(scores, width)
    keep = keep if fillers else None
    out, mass = selected_attention(q, k, v, index, keep, 0.3, with_mass=True)
    ref = gathered_attention(q, k, v, index, keep, 0.3)
    torch.testing.assert_close(out, ref, **TOL)
    allowed = topk_mask(scores, width)
    _, p = grouped_attention(q.detach(), k.detach(), v.detach(), allowed[:, None, None], 0.3)  # [B, H_kv, G, T, S]
    dense_mass = p.sum(dim=2).gather(-1, index[:, None].expand(-1, Hkv, -1, -1))  # [B, H_kv, T, width]
    if keep is not None:
        dense_mass = dense_mass * keep[:, None]
    torch.testing.assert_close(mass, dense_mass, **TOL)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA only: the Triton 3.9 interpreter's tl.dot misreads bfloat16")
def test_selected_attention_in_bfloat16_is_close_to_the_float32_reference():
    from looplm.ops.sparse.selected_triton import selected_attention

    q, k, v, scores = _inputs(2, 2, 2, 6, 48, 16, 16, 16, torch.float32, seed=3)
    index, keep = topk_indices(scores, 16)
    ref = gathered_attention(q, k, v, index, keep, 0.25)
    out, _ = selected_attention(*(x.detach().bfloat16().requires_grad_(True) for x in (q, k, v)), index, keep, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@runs_kernels
@pytest.mark.parametrize("index_loss,padded,block,top_k", [(False, True, 256, 5), (True, True, 5, 5),
                                                          (True, False, 256, 5), (False, True, 256, 12),
                                                          (True, True, 3, 12)])
def test_dsa_attention_kernel_equals_the_reference(index_loss, padded, block, top_k):
    """Output, indexer loss and the gradients of all six inputs, with the kernel and with the
    PyTorch reference (gathered keys in evaluation, dense masked attention in training);
    top_k 12 puts the first 4 of the 13 queries (positions 8-11) on the dense SDPA path."""
    g = torch.Generator().manual_seed(5)
    B, T, S, Hkv, G, D, HI, DI = 2, 13, 21, 2, 2, 8, 3, 8
    shapes = ((B, Hkv, G, T, D), (B, Hkv, S, D), (B, Hkv, S, D), (B, T, HI, DI), (B, S, DI), (B, T, HI))
    inputs = [torch.randn(*shape, generator=g).to(DEVICE).requires_grad_(True) for shape in shapes]
    valid = torch.ones(B, S, dtype=torch.bool, device=DEVICE)
    valid[0, :6] = False
    args = dict(top_k=top_k, scale=0.3, index_loss=index_loss, block=block)
    results = {}
    for kernel in ("torch", "triton"):
        o, loss = dsa_attention(*inputs, valid if padded else None, kernel=kernel, **args)
        total = (o * torch.linspace(-1, 1, o.numel(), device=DEVICE).view(o.shape)).sum() + (loss if index_loss else 0)
        results[kernel] = (o, loss, torch.autograd.grad(total, inputs, allow_unused=True))
    (o_ref, loss_ref, grads_ref), (o, loss, grads) = results["torch"], results["triton"]
    torch.testing.assert_close(o, o_ref, **TOL)
    if index_loss:
        torch.testing.assert_close(loss, loss_ref, **TOL)
    for a, b in zip(grads, grads_ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **TOL)


@runs_kernels
def test_dsa_prefill_through_the_kernel_allocates_nothing_of_size_t_k_d():
    """A prefill past top_k through the kernel allocates at most a block's index products
    [B, block, H^I, S] and the queries' output: never the B·H_kv·T·k·D of gathered rows
    (here 16 times the largest allocation)."""
    from tests.ops.test_dsa import LargestAllocation

    g = torch.Generator().manual_seed(2)
    B, T, Hkv, G, D, HI, DI, top_k, block = 1, 128, 2, 2, 16, 2, 8, 32, 16
    shapes = ((B, Hkv, G, T, D), (B, Hkv, T, D), (B, Hkv, T, D), (B, T, HI, DI), (B, T, DI), (B, T, HI))
    inputs = [torch.randn(*shape, generator=g).to(DEVICE) for shape in shapes]
    with torch.no_grad(), LargestAllocation() as mode:
        dsa_attention(*inputs, None, top_k=top_k, scale=0.25, block=block, kernel="triton")
    assert mode.largest <= max(B * block * HI * T, B * Hkv * G * T * D), (mode.largest, mode.op)
    assert 16 * mode.largest <= B * Hkv * T * top_k * D


@runs_kernels
def test_a_dsa_model_trains_and_decodes_alike_with_the_kernel():
    """Loss (language model + indexer) and every parameter's gradient with the kernel equal
    the reference's; greedy decoding after a kernel prefill gives the reference's tokens."""
    mixer = {"kind": "dsa", "top_k": 3, "index_heads": 2, "index_head_dim": 8}
    torch.manual_seed(0)
    ref = LoopLM(tiny_config("mesh", layout="1R2", mixer={**mixer, "kernel": "torch"})).to(DEVICE)
    fast = LoopLM(tiny_config("mesh", layout="1R2", mixer={**mixer, "kernel": "triton"})).to(DEVICE)
    fast.load_state_dict(ref.state_dict())
    ids, targets = random_ids(2, 9).to(DEVICE), random_ids(2, 9, seed=1).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    outputs = [m.train()(ids, targets, attention_mask=mask) for m in (ref, fast)]
    torch.testing.assert_close(outputs[1].loss, outputs[0].loss, **TOL)
    for out in outputs:
        out.loss.backward()
    for (name, a), b in zip(fast.named_parameters(), ref.parameters()):
        if b.grad is None:
            assert a.grad is None, name
        else:
            torch.testing.assert_close(a.grad, b.grad, **TOL, msg=name)
    with torch.no_grad():
        tokens = [m.eval().generate(ids, max_new_tokens=2, temperature=0).sequences for m in (ref, fast)]
    assert torch.equal(tokens[0], tokens[1])


@runs_kernels
def test_selected_attention_compiles_as_one_opaque_operator():
    """Under torch.compile(fullgraph=True) the kernel is a custom operator (no graph break,
    no tracing into Triton), forward and backward as in eager."""
    from looplm.ops.sparse.selected_triton import selected_attention

    q, k, v, scores = _inputs(1, 2, 2, 4, 24, 16, 16, 5, torch.float32, seed=7)
    index, keep = topk_indices(scores, 5)
    compiled = torch.compile(lambda q, k, v: selected_attention(q, k, v, index, keep, 0.3, with_mass=True),
                             fullgraph=True, backend="aot_eager")
    (out, mass), (ref, ref_mass) = compiled(q, k, v), selected_attention(q, k, v, index, keep, 0.3, with_mass=True)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(mass, ref_mass, atol=0, rtol=0)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, **TOL)
