"""Feed-forward networks: GELU MLP (GPT-NeoX) and SwiGLU (LLaMA).

Every FFN of a block is called ``ffn(x, ctx)``: the dense ones ignore ``ctx``; the
mixture of experts (:mod:`looplm.modules.moe`) adds its auxiliary losses to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GeluMLP(nn.Module):
    """up -> GELU (exact, as GPT-NeoX) -> down."""

    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class SwiGLU(nn.Module):
    """down(SiLU(gate(x)) * up(x)) (Shazeer 2020; LLaMA)."""

    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=bias)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def build_mlp(kind: str, dim: int, hidden: int, bias: bool) -> nn.Module:
    return SwiGLU(dim, hidden, bias) if kind == "swiglu" else GeluMLP(dim, hidden, bias)
