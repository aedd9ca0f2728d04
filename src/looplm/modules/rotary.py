"""Rotary position embeddings (RoFormer), full or partial (GPT-NeoX's ``rotary_pct``).

Tables are computed once per forward from explicit position ids and passed to every
attention layer, so left-padded batches and cached decoding use the same code path.
"""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    """Produces ``(cos, sin)`` of shape [B, T, rotary_dim] for position ids [B, T].

    ``sin`` carries the rotation's sign, [-sin θ | sin θ], so that a rotation is
    x·cos + swap_halves(x)·sin: three operators (:func:`apply_rotary`), not five."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / max(rotary_dim, 1)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> angles: [B, T, rotary_dim / 2]
        angles = positions.to(torch.float32)[..., None] * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoFormer's rotation x·cos + rotate_half(x)·sin on the first R = cos.shape[-1]
    channels of x, written x·cos + [x₂ | x₁]·sin with the sign in :class:`Rotary`'s sin
    table; the tables already broadcast against x. Full rotary (R = D) skips the
    pass-through concatenation: three operators for any number of heads."""
    rot = cos.shape[-1]
    if rot == 0:
        return x
    x_rot = x if rot == x.shape[-1] else x[..., :rot]
    x1, x2 = x_rot.chunk(2, dim=-1)
    out = torch.addcmul(x_rot * cos, torch.cat([x2, x1], dim=-1), sin)
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of x [B, H, T, D]; cos/sin are [B, T, R]."""
    return _rotate(x, cos[:, None], sin[:, None])


def apply_rotary_heads_last(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation for x [B, T, N, D] (heads after time, as a projection lays them
    out), so queries and keys projected together rotate in one pass; cos/sin: [B, T, R]."""
    return _rotate(x, cos[:, :, None], sin[:, :, None])
