"""Rotary embeddings: tables looked up equal tables computed per call, and the rotation's
hand-written backward (the rotation by -θ) equals autograd's chain, in fewer operators."""

from __future__ import annotations

import pytest
import torch

from looplm.accounting.dispatch import count_dispatch
from looplm.modules.rotary import Rotary, _rotated, apply_rotary, apply_rotary_heads_last, split_rotated_qkv


def test_table_lookup_equals_tables_computed_per_call():
    computed, looked_up = Rotary(16, 10000.0), Rotary(16, 10000.0, max_positions=512)
    positions = torch.randint(0, 512, (3, 20), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        for a, b in zip(computed(positions, dtype), looked_up(positions, dtype)):
            assert torch.equal(a, b) and a.dtype == dtype
    one, _ = count_dispatch(lambda: looked_up(positions, torch.float32))
    assert one.ops == 1, one.by_op  # one gather


@pytest.mark.parametrize("rotary_dim", [16, 8])
@pytest.mark.parametrize("heads_last", [True, False])
def test_rotation_backward_equals_autograd_in_fewer_operators(rotary_dim, heads_last):
    torch.manual_seed(0)
    cos, sin = Rotary(rotary_dim, 10000.0, max_positions=64)(torch.arange(7).expand(2, 7), torch.float32)
    shape = (2, 7, 3, 16) if heads_last else (2, 3, 7, 16)
    apply = apply_rotary_heads_last if heads_last else apply_rotary
    c, s = (cos[:, :, None], sin[:, :, None]) if heads_last else (cos[:, None], sin[:, None])
    x, g = torch.randn(shape, requires_grad=True), torch.randn(shape)
    y = apply(x, cos, sin)
    assert torch.equal(y, _rotated(x, c, s))
    got, want = torch.autograd.grad(y, x, g)[0], torch.autograd.grad(_rotated(x, c, s), x, g)[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    fused, _ = count_dispatch(lambda: torch.autograd.grad(apply(x, cos, sin), x, g))
    chain, _ = count_dispatch(lambda: torch.autograd.grad(_rotated(x, c, s), x, g))
    assert fused.ops < chain.ops, (fused.by_op, chain.by_op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("heads", [(3, 3), (4, 2), (2, 1)], ids=["mha", "gqa", "mqa"])
def test_split_rotated_qkv_backward_is_the_rotation_by_minus_theta(heads, rotary, dtype):
    """split_rotated_qkv's hand-written backward (the concatenation of the three gradients,
    q's and k's turned back by -θ in place) against autograd's chain through the slices and
    the plain rotation (``_rotated``), on odd sizes, for full, partial and no rotary tables;
    bf16 projections with float32 tables as under autocast (q, k float32, v and every
    gradient bf16); in four backward operators where autograd's chain takes more. The head
    loop's passes split their projections with it too (n_q = n_kv = |S|)."""
    torch.manual_seed(0)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    (n_q, n_kv), B, T, D = heads, 2, 5, 8
    R = int(D * rotary)
    angles = torch.randn(B, T, R // 2)
    cos = torch.cat([angles.cos()] * 2, dim=-1)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    qkv = torch.randn(B, T, n_q + 2 * n_kv, D).to(dtype).requires_grad_()
    table_dtype = torch.float32 if R else dtype  # no rotary channels: q and k stay in qkv's dtype
    grads = [torch.randn(B, T, n, D).to(dt) for n, dt in ((n_q, table_dtype), (n_kv, table_dtype), (n_kv, dtype))]

    def plain(x):  # autograd's own chain: slices, the rotation's operators, the sums of the slices' gradients
        qk = _rotated(x[:, :, : n_q + n_kv], cos[:, :, None], sin[:, :, None]) if R else x[:, :, : n_q + n_kv]
        return qk[:, :, :n_q], qk[:, :, n_q:], x[:, :, n_q + n_kv:]

    want_out, got_out = plain(qkv), split_rotated_qkv(qkv, cos, sin, n_q, n_kv)
    for a, b in zip(got_out, want_out):
        assert torch.equal(a, b)
    want = torch.autograd.grad(want_out, qkv, grads)[0]
    got = torch.autograd.grad(got_out, qkv, grads)[0]
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    with torch.no_grad():  # views and the plain rotation where no gradient is taken
        for a, b in zip(split_rotated_qkv(qkv, cos, sin, n_q, n_kv), want_out):
            assert torch.equal(a, b)

    def backward(outs):
        return lambda: torch.autograd.grad(outs, qkv, grads)

    hand, _ = count_dispatch(backward(split_rotated_qkv(qkv, cos, sin, n_q, n_kv)))
    chain, _ = count_dispatch(backward(plain(qkv)))
    assert hand.ops <= (4 if R else 1) + (dtype != torch.float32 and R > 0), hand.by_op  # + the cast back to bf16
    assert hand.ops < chain.ops, (hand.by_op, chain.by_op)
