"""Down-scaling operators S↓ (spiralformer.txt §2.3.2): chunk tokens -> one latent per chunk.

Both take the tokens of whole chunks laid out on a grid, x [B, n, g, d], and a mask
[n, g] of the slots that hold a position of the sequence (False only at the start of
chunk 0 when the offset ω > 0 makes it shorter than g), and return z [B, n, d].
"""

from __future__ import annotations

import torch
from torch import nn


class MeanPool(nn.Module):
    """z_j = (1/g) Σ_{i ∈ I_j} h_i, Eq. (16). Divides by g even for a short first chunk,
    exactly as the equation writes it (Algorithm 2's zero-initialised buffer does the same)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        g = x.shape[2]
        return (x * mask[None, :, :, None]).sum(dim=2) / g  # Eq. (16)


class SelfAggregation(nn.Module):
    """z_j = Σ_{i ∈ I_j} α_{j,i} h_i with α_j = softmax over the chunk of A(h_i), Eq. (17-18).

    ``scorer`` is the iteration's A^(t): d -> 1, one linear layer. The softmax runs over the
    chunk's positions only (Eq. 17), so a short first chunk is not diluted by empty slots.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.scorer = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.scorer(x).squeeze(-1)  # [B, n, g]
        scores = scores.float().masked_fill(~mask[None], float("-inf"))
        alpha = torch.softmax(scores, dim=-1).to(x.dtype)  # Eq. (17)
        return torch.einsum("bng,bngd->bnd", alpha, x)  # Eq. (18)


def build_down(kind: str, dim: int, chunk: int) -> nn.Module:
    """``mean`` or ``aggregate``; at g = 1 both are the identity, so no scorer is built."""
    if kind == "aggregate" and chunk > 1:
        return SelfAggregation(dim)
    return MeanPool()
