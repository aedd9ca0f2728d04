"""The dense FFNs add the residual stream inside their down projection (one ``addmm``):
the same numbers as the projection followed by the add, in a block and alone, and the
plain path wherever the fusion does not apply (bias, autocast, adapted linears)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from looplm.accounting.dispatch import count_dispatch
from looplm.modules.mlp import GeluMLP, SwiGLU, add_projection


@pytest.mark.parametrize("mlp", [SwiGLU, GeluMLP])
@pytest.mark.parametrize("bias", [False, True])
def test_residual_ffn_equals_projection_then_add(mlp, bias):
    torch.manual_seed(0)
    ffn = mlp(16, 40, bias)
    x, residual = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    fused = ffn(x, residual=residual)
    torch.testing.assert_close(fused, residual + ffn(x), atol=1e-6, rtol=1e-6)
    grads = torch.autograd.grad(fused.square().sum(), list(ffn.parameters()))
    plain = torch.autograd.grad((residual + ffn(x)).square().sum(), list(ffn.parameters()))
    for a, b in zip(grads, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        together, _ = count_dispatch(lambda: ffn(x, residual=residual))
        apart, _ = count_dispatch(lambda: residual + ffn(x))
    assert together.ops == apart.ops - (0 if bias else 1), (together.by_op, apart.by_op)


def test_add_projection_keeps_the_add_where_it_cannot_fold():
    torch.manual_seed(0)
    linear = nn.Linear(8, 4, bias=False)
    x, residual = torch.randn(3, 8), torch.randn(3, 4)
    with torch.no_grad():
        folded, _ = count_dispatch(lambda: add_projection(residual, x, linear))
        assert folded.by_op["aten.addmm"] == 1 and folded.ops == 1
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the residual stays float32
            out = add_projection(residual, x, linear)
        assert out.dtype == torch.float32
        half, _ = count_dispatch(lambda: add_projection(residual, x.double(), linear.double()))
        assert half.by_op["aten.addmm"] == 0  # the residual's dtype differs from the weight's
