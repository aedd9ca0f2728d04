"""Normalisation layers: RMSNorm (LLaMA) and LayerNorm with bias (GPT-NeoX)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in float32 as LLaMA does, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``rmsnorm`` -> RMSNorm, ``layernorm`` -> nn.LayerNorm with bias (GPT-NeoX)."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    return nn.LayerNorm(dim, eps=eps)
