"""Rotary embeddings: tables looked up equal tables computed per call, and the rotation's
hand-written backward (the rotation by -θ) equals autograd's chain, in fewer operators."""

from __future__ import annotations

import pytest
import torch

from looplm.accounting.dispatch import count_dispatch
from looplm.modules.rotary import Rotary, _rotated, apply_rotary, apply_rotary_heads_last


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
