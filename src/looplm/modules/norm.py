"""Normalisation layers: RMSNorm (LLaMA), LayerNorm with bias (GPT-NeoX), and the gated
RMSNorm the linear mixers put on their outputs (flash-linear-attention's)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost
from looplm.ops.backend import use_fla


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in float32 as LLaMA does, returned in the input dtype and
    then scaled (LLaMA's order). Where x and the weight share a dtype, one ``F.rms_norm``
    call with the weight: one fused kernel on CUDA instead of four (the casts and the
    product outside it); in float32 the same arithmetic, in bf16 the weight is applied
    before the one rounding (LLaMA rounds twice). Mixed dtypes (autocast over float32
    parameters) keep LLaMA's order, whose float32 product the residual stream expects."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def flop_cost(self, call: Call) -> Cost:
        return Cost(norm=call.rows * self.weight.shape[0] * 4)  # square, mean, scale, weight


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
        """x, g: [..., dim] -> [..., dim] in x's dtype. On CUDA with flash-linear-attention,
        fla's fused kernel (``rms_norm_gated``, what ``FusedRMSNormGated`` runs) where it
        applies (gate after the norm, no groups); else six operators."""
        if self.norm_before_gate and self.group_size is None and use_fla(x):
            from fla.modules.fused_norm_gate import rms_norm_gated

            return rms_norm_gated(x, g, self.weight, None, activation=self.activation, eps=self.eps)
        x32 = x.float()
        gate = gate_activation(g.float(), self.activation)
        if not self.norm_before_gate:
            x32 = x32 * gate
        n = self.group_size or x32.shape[-1]
        normed = rms_scaled(x32.unflatten(-1, (-1, n)), self.eps).flatten(-2)  # over groups of n
        scale = self.weight * gate if self.norm_before_gate else self.weight
        y = (normed * scale).mul_(n**0.5)  # √n · normed · scale
        return y.to(x.dtype)

    def flop_cost(self, call: Call) -> Cost:
        return Cost(norm=call.rows * self.weight.shape[0] * 5)  # RMSNorm + gate multiply


def host_scalar(value: float) -> torch.Tensor:
    """A 0-dim CPU tensor: an operand a binary op on any device reads as a kernel argument
    (``x.new_tensor(value)`` would copy it to the device on every call, a host sync on CUDA)."""
    return torch.tensor(value)


def l2_scaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim (fla's ``l2norm``) in three operators:
    sqrt(Σ x² + eps) = hypot(‖x‖, √eps)."""
    return x / torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), host_scalar(eps**0.5))


def rms_scaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / (√n · rms(x)) over the last dim (n wide), rms(x) = sqrt(mean x² + eps): the L2
    normalisation with n·eps (:func:`l2_scaled`), one operator fewer than the mean of
    squares, eps added, rsqrt. The caller multiplies √n back in with its weight."""
    return l2_scaled(x, x.shape[-1] * eps)


def gate_activation(g: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated norms' act(g): SiLU (``swish``) or ``sigmoid``."""
    return F.silu(g) if activation == "swish" else torch.sigmoid(g)
