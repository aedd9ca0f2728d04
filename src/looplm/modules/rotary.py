"""Rotary position embeddings (RoFormer), full or partial (GPT-NeoX's ``rotary_pct``).

Tables are computed once per forward from explicit position ids and passed to every
attention layer, so left-padded batches and cached decoding use the same code path.
"""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    """Produces ``(cos, sin)`` of shape [B, T, rotary_dim] for position ids [B, T]."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / max(rotary_dim, 1)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> angles: [B, T, rotary_dim / 2]
        angles = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat([angles, angles], dim=-1)  # [B, T, rotary_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of x [B, H, T, D]; cos/sin are [B, T, R]."""
    rot = cos.shape[-1]
    if rot == 0:
        return x
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, R]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x_rot = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat([x_rot, x_pass], dim=-1)
