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
    Returns (y [B, T, C], the new state [B, C, K-1]). One ``cat`` (a ``pad`` without state),
    one convolution and the activation whatever T (a decoding step included), so several
    streams concatenated on C convolve in one call. The convolution reads x in its own
    [B, T, C] layout, as a [B, C, 1, T] image in channels-last strides, and writes y in it:
    no transposed copy forward or backward (on a CPU the [B, C, T] form's backward was 3-4×
    slower, reordering both gradients).
    """
    T, C = x.shape[1], x.shape[2]
    K = weight.shape[-1]
    if state is None:
        full = F.pad(x, (0, 0, K - 1, 0))  # [B, K-1+T, C]: zeros before the first input
    else:
        full = torch.cat([state.transpose(1, 2).to(x.dtype), x], dim=1)
    y = F.conv2d(full.transpose(1, 2).unsqueeze(2), weight.unsqueeze(2), bias, groups=C)  # [B, C, 1, T]
    if activation == "silu":
        y = F.silu(y)
    return y.squeeze(2).transpose(1, 2), full[:, T:].transpose(1, 2)


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
