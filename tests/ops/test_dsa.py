"""DSA's split at position top_k (issue 30): queries that select every candidate run as one
causal SDPA call, the later ones score, select and attend block by block. Both together equal
DSA's definition — the top-k of the masked index scores, dense masked attention over them,
the indexer loss over the selection (DeepSeek-V3.2 Eq. (1)-(3)) — forward, backward and loss,
over every option the op has: padding (and a padding query), GQA, chunks of a cache, a single
decoding query, query blocks, top-k below, across and above the queries' positions. Prefill
memory: nothing of size T·k·D or T·S is allocated."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from looplm.ops.sparse import dsa_attention, grouped_attention, index_kl_sum, index_scores, topk_mask


def _inputs(B, Hkv, G, T, S, D=8, HI=3, DI=8, padded=False, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(True) for shape in
               ((B, Hkv, G, T, D), (B, Hkv, S, D), (B, Hkv, S, D), (B, T, HI, DI), (B, S, DI), (B, T, HI))]
    valid = None
    if padded:
        valid = torch.ones(B, S, dtype=torch.bool)
        valid[0, :5] = False  # left padding
        valid[-1, -1] = False  # a padding query: it sees only itself
    return tensors, valid


def _reference(q, k, v, q_index, k_index, w_index, valid, top_k, scale):
    """DSA by its definition, every query at once: the candidates (causal and real; a padding
    query only itself), the top-k of their index scores, dense masked attention over the
    selected keys and the mean KL over real queries (Eq. (3))."""
    B, T, S = q.shape[0], q.shape[3], k.shape[2]
    query = torch.arange(S - T, S)[None, :, None]
    key = torch.arange(S)[None, None, :]
    candidates = (key <= query).expand(B, T, S)
    query_valid = torch.ones(B, T, dtype=torch.bool)
    if valid is not None:
        query_valid = valid[:, S - T:]
        candidates = torch.where(query_valid[..., None], candidates & valid[:, None, :], key == query)
    scores = index_scores(q_index, k_index, w_index)
    selected = topk_mask(scores.masked_fill(~candidates, float("-inf")), top_k)
    o, p = grouped_attention(q, k, v, selected[:, None, None], scale)
    total, rows = index_kl_sum(scores, p.detach().sum(dim=(1, 2)), selected & query_valid[..., None], query_valid)
    return o, total / rows.clamp_min(1)


CASES = [  # (B, Hkv, G, T, S, top_k, block): top_k below, across and above the queries' positions
    (2, 2, 2, 19, 19, 7, 5), (2, 1, 3, 19, 19, 19, 4), (1, 2, 1, 17, 17, 40, 256), (2, 2, 2, 9, 30, 25, 4),
    (2, 2, 2, 9, 30, 30, 256), (2, 2, 2, 9, 30, 5, 3), (2, 2, 2, 1, 12, 12, 256), (2, 2, 2, 1, 12, 13, 256),
    (2, 1, 2, 1, 12, 4, 256),
]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("B, Hkv, G, T, S, top_k, block", CASES)
def test_dense_queries_and_selected_blocks_equal_the_definition(B, Hkv, G, T, S, top_k, block, padded):
    results = []
    for run in ("op", "reference"):
        tensors, valid = _inputs(B, Hkv, G, T, S, padded=padded)
        if run == "op":
            o, loss = dsa_attention(*tensors, valid, top_k=top_k, scale=0.3, index_loss=True, block=block)
        else:
            o, loss = _reference(*tensors, valid, top_k, 0.3)
        (o * torch.linspace(-1, 1, o.shape[-1])).sum().add(loss).backward()
        results.append((o.detach(), loss.detach(), [t.grad for t in tensors]))
        with torch.no_grad():  # inference: the loss-free path (dense queries skip the indexer)
            inferred, none = dsa_attention(*(t.detach() for t in tensors), valid, top_k=top_k, scale=0.3, block=block)
        assert none is None
        torch.testing.assert_close(inferred, results[0][0], atol=1e-6, rtol=1e-5)
    (o, loss, grads), (o_ref, loss_ref, grads_ref) = results
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loss, loss_ref, atol=1e-6, rtol=1e-5)
    for name, a, b in zip(["q", "k", "v", "q_index", "k_index", "w_index"], grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("T, S", [(16, 16), (5, 16), (1, 16)])
def test_queries_under_top_k_need_no_index_queries(T, S, padded):
    """Every query at a position < top_k: the index queries and weights are never read
    (the mixer does not project them) and the output is causal attention."""
    (q, k, v, q_index, k_index, w_index), valid = _inputs(2, 2, 2, T, S, padded=padded)
    with torch.no_grad():
        o, _ = dsa_attention(q, k, v, None, k_index, None, valid, top_k=S, scale=0.3)
        reference, _ = _reference(q, k, v, q_index, k_index, w_index, valid, S, 0.3)
    torch.testing.assert_close(o, reference, atol=1e-6, rtol=1e-5)


def test_bfloat16_dense_and_selected_queries_follow_the_float32_definition():
    (q, k, v, q_index, k_index, w_index), valid = _inputs(2, 2, 2, 24, 24, padded=True)
    with torch.no_grad():
        o, _ = dsa_attention(*(t.bfloat16() for t in (q, k, v)), q_index, k_index, w_index, valid, top_k=9, scale=0.3)
        reference, _ = _reference(q, k, v, q_index, k_index, w_index, valid, 9, 0.3)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), reference, atol=2e-2, rtol=2e-2)


class LargestAllocation(TorchDispatchMode):
    """The largest tensor (in elements) any dispatched operator allocates (views left out)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), func
        return out


@pytest.mark.parametrize("T", [256, 512])
def test_dense_prefill_allocates_no_scores(T):
    """A prefill under top_k (LT2 0.6B at S = 2048, top_k = 2048) allocates nothing larger
    than its queries: no [T, S] scores or probabilities, no index scores, no top-k."""
    (q, k, v, q_index, k_index, w_index), _ = _inputs(1, 2, 2, T, T, D=16)
    with torch.no_grad(), LargestAllocation() as mode:
        dsa_attention(q, k, v, q_index, k_index, w_index, None, top_k=T, scale=0.25)
    assert mode.largest <= q.numel(), (mode.largest, mode.op)


class Shapes(TorchDispatchMode):
    """(operator, shape) of every tensor the dispatched operators write (views left out)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func is torch.ops.aten.detach.default:
            return out
        self.shapes += [(str(func), tuple(t.shape)) for t in (out if isinstance(out, (tuple, list)) else [out])
                        if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("T, S", [(12, 12), (5, 12), (1, 12)])
def test_a_padded_dense_prefill_reads_grouped_heads_in_place(T, S, monkeypatch):
    """Under a padding mask the dense queries read the H_kv key/value heads as they are
    (SDPA's grouped heads on CPU; one query folded into the query axis anywhere): no K or V
    repeated to every query head, and the same values and gradients as the copies that a
    kernel without grouped heads (CUDA with a mask) is handed."""
    from looplm.ops.sparse import dsa

    results = []
    for in_place in (True, False):
        monkeypatch.setattr(dsa, "reads_grouped_heads", lambda q, mask: in_place)
        tensors, valid = _inputs(2, 2, 3, T, S, padded=True)
        q, k, v = tensors[:3]
        with Shapes() as made:
            o, _ = dsa_attention(q, k, v, None, tensors[4], None, valid, top_k=S, scale=0.3)
        copies = [op for op, shape in made.shapes if math.prod(shape) == 2 * 6 * S * 8 and "scaled_dot" not in op]
        assert bool(copies) == (not in_place and T > 1), copies  # K, V repeated to the 6 query heads
        o.square().sum().backward()
        results.append([o.detach()] + [t.grad for t in (q, k, v)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_a_decoding_step_folds_grouped_heads_over_its_picks(padded):
    """Past top_k a decoding step attends over its k picked keys as one MHA-shaped call: each
    kv head's G query heads folded into the query axis ([B, H_kv, G, D] queries), which
    every kernel takes with the fillers' mask; not H query heads over grouped keys, which
    sends a masked call on CUDA to the math kernel and its copies. Same values."""
    from looplm.ops.sparse import dsa

    (q, k, v, q_index, k_index, w_index), valid = _inputs(2, 2, 4, 1, 40, padded=padded)
    with torch.no_grad(), Shapes() as made:
        o = dsa.decode_step(q, k, v, q_index, k_index, w_index, valid, top_k=8, scale=0.3)
    reference, _ = _reference(q, k, v, q_index, k_index, w_index, valid, 8, 0.3)
    calls = [shape for op, shape in made.shapes if "scaled_dot_product" in op and len(shape) == 4]
    assert calls == [(2, 2, 4, 8)], made.shapes
    torch.testing.assert_close(o, reference, atol=1e-6, rtol=1e-5)


def test_sparse_prefill_allocates_per_block_not_per_sequence():
    """Past top_k, the reference's gathered keys and values are bounded by the query block
    (block·k·D per KV head), like the block's index products (block·H^I·S): nothing grows
    with T·k·D (on CUDA the Triton kernel gathers nothing, tests/ops/test_selected_triton.py)."""
    B, Hkv, D, HI, top_k, block = 1, 2, 16, 3, 16, 32
    for T in (128, 256):
        (q, k, v, q_index, k_index, w_index), _ = _inputs(B, Hkv, 2, T, T, D=D, HI=HI)
        with torch.no_grad(), LargestAllocation() as mode:
            dsa_attention(q, k, v, q_index, k_index, w_index, None, top_k=top_k, scale=0.25, block=block)
        per_block = max(B * Hkv * block * top_k * D, B * block * HI * T)
        assert mode.largest <= per_block < B * Hkv * T * top_k * D, (T, mode.largest, mode.op)
