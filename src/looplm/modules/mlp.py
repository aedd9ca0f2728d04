"""Feed-forward networks: GELU MLP (GPT-NeoX) and SwiGLU (LLaMA).

Every FFN of a block is called ``ffn(x, ctx)``: the dense ones ignore ``ctx``; the
mixture of experts (:mod:`looplm.modules.moe`) adds its auxiliary losses to it. The
dense ones also take ``residual`` and return residual + FFN(x) with the add folded into
the down projection (:func:`add_projection`): one operator fewer per block pass."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def add_product(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """residual + x·weightᵀ: one ``addmm`` (the add done by the GEMM) when all three share
    a dtype outside autocast (autocast would cast the float32 residual stream to bf16);
    otherwise the product, then the add."""
    if residual.dtype == x.dtype == weight.dtype and not torch.is_autocast_enabled(x.device.type):
        flat = torch.addmm(residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t())
        return flat.view(residual.shape)
    return residual + F.linear(x, weight)


def add_projection(residual: torch.Tensor, x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """residual + linear(x), the add folded into the GEMM (:func:`add_product`) for a
    bias-free ``nn.Linear``."""
    if type(linear) is nn.Linear and linear.bias is None:
        return add_product(residual, x, linear.weight)
    return residual + linear(x)


def _project(linear: nn.Module, h: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
    return linear(h) if residual is None else add_projection(residual, h, linear)


class GeluMLP(nn.Module):
    """up -> GELU (exact, as GPT-NeoX) -> down."""

    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor, ctx=None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _project(self.down, F.gelu(self.up(x)), residual)


class SwiGLU(nn.Module):
    """down(SiLU(gate(x)) * up(x)) (Shazeer 2020; LLaMA)."""

    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=bias)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor, ctx=None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _project(self.down, F.silu(self.gate(x)) * self.up(x), residual)


def build_mlp(kind: str, dim: int, hidden: int, bias: bool) -> nn.Module:
    return SwiGLU(dim, hidden, bias) if kind == "swiglu" else GeluMLP(dim, hidden, bias)
