"""Normalisation layers: RMSNorm (LLaMA), LayerNorm with bias (GPT-NeoX), and the gated
RMSNorm the linear mixers put on their outputs (flash-linear-attention's)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in float32 as LLaMA does, returned in the input dtype and
    then scaled (LLaMA's order). ``F.rms_norm`` is one fused kernel on CUDA."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``rmsnorm`` -> RMSNorm, ``layernorm`` -> nn.LayerNorm with bias (GPT-NeoX)."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    return nn.LayerNorm(dim, eps=eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm with a gate g, in float32, weight initialised to ones.

    ``norm_before_gate`` (fla's ``FusedRMSNormGated``: RetNet, GLA, DeltaNet, GDN, KDA):
    y = rms(x)·w·act(g); otherwise (fla's ``RMSNormGated``, Mamba2): y = rms(x·act(g))·w.
    act is SiLU (``swish``) or ``sigmoid``. ``group_size``: the RMS is taken over groups of
    that many channels (Mamba2's n_groups); None: over all.
    """

    def __init__(self, dim: int, eps: float = 1e-5, activation: str = "swish", norm_before_gate: bool = True,
                 group_size: Optional[int] = None):
        super().__init__()
        if activation not in ("swish", "sigmoid"):
            raise ValueError(f"activation={activation!r} is invalid: 'swish' or 'sigmoid'")
        self.eps, self.activation = eps, activation
        self.norm_before_gate, self.group_size = norm_before_gate, group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, activation={self.activation}, norm_before_gate={self.norm_before_gate}"

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """x, g: [..., dim] -> [..., dim] in x's dtype."""
        x32 = x.float()
        gate = F.silu(g.float()) if self.activation == "swish" else torch.sigmoid(g.float())
        if not self.norm_before_gate:
            x32 = x32 * gate
        groups = x32.unflatten(-1, (-1, self.group_size or x32.shape[-1]))  # [..., G, dim / G]
        y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2) * self.weight
        if self.norm_before_gate:
            y = y * gate
        return y.to(x.dtype)
