"""Depthwise causal short convolution (H3, Mamba, fla's ``ShortConvolution``).

Used by the linear mixers on q/k/v before the recurrence. Its decoding state is the last
K - 1 inputs, so incremental decoding gives the same outputs as the full convolution.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state: Optional[torch.Tensor],
    activation: Optional[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t = act(Σ_{i<K} w_i ⊙ x_{t-K+1+i} + b) channel by channel, continuing from ``state``.

    x: [B, T, C]; weight: [C, 1, K] (``nn.Conv1d(C, C, K, groups=C)``'s); bias: [C] or None;
    state: [B, C, K-1], the previous inputs (None: zeros); activation: None or ``silu``.
    Returns (y [B, T, C], the new state [B, C, K-1]). One ``cat``, one convolution and the
    activation whatever T (a decoding step included), so several streams concatenated on C
    convolve in one call.
    """
    B, T, C = x.shape
    K = weight.shape[-1]
    xt = x.transpose(1, 2)  # [B, C, T]
    if state is None:
        state = xt.new_zeros(B, C, K - 1)
    full = torch.cat([state.to(xt.dtype), xt], dim=-1)  # [B, C, K-1+T]
    y = F.conv1d(full, weight, bias, groups=C)  # [B, C, T]
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(1, 2), full[..., full.shape[-1] - (K - 1) :]


class ShortConvolution(nn.Conv1d):
    """y_t = act(Σ_{i<K} w_i ⊙ x_{t-K+1+i} + b), channel by channel (groups = channels).

    Parameters are those of ``nn.Conv1d(C, C, K, groups=C)`` (weight [C, 1, K]), as in
    flash-linear-attention, so weights move between the two unchanged.
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False, activation: Optional[str] = "silu"):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=bias, padding=0)
        if activation not in (None, "silu"):
            raise ValueError(f"activation={activation!r} is invalid: None or 'silu'")
        self.activation = activation

    def forward(
        self, x: torch.Tensor, state: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, C]; state: [B, C, K-1], the previous inputs (None: zeros); valid: [B, T]
        bool, False where x is left padding (treated as zeros). Returns ([B, T, C], state)."""
        if valid is not None:
            x = x * valid[..., None].to(x.dtype)
        return causal_conv1d(x, self.weight, self.bias, state, self.activation)
