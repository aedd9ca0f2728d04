"""Up-scaling operators S↑ (spiralformer.txt §2.3.3): u_i = λ_t β_{π(i),ρ(i)} ẑ_{π(i)}, Eq. (19).

Both take, for each position, the latent of its chunk ẑ [B, T, d] and its in-chunk index
ρ [T] (long), and return u [B, T, d]. λ_t = √g_t calibrates the update magnitude across
chunk sizes.
"""

from __future__ import annotations

import torch
from torch import nn


class UniformBroadcast(nn.Module):
    """β_{j,ρ} = 1/g: u_i = (λ_t / g_t) ẑ_{π(i)}, Eq. (20)."""

    def __init__(self, chunk: int):
        super().__init__()
        self.chunk = chunk
        self.gain = chunk**0.5  # λ_t = √g_t (§2.3.3)

    def extra_repr(self) -> str:
        return f"chunk={self.chunk}, gain={self.gain:g}"

    def forward(self, z: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        return z * (self.gain / self.chunk)  # Eq. (20)


class AllocationRouter(nn.Module):
    """β_j = softmax(B(ẑ_j)) ∈ R^g, Eq. (21); ``router`` is the iteration's B^(t): d -> g."""

    def __init__(self, dim: int, chunk: int):
        super().__init__()
        self.chunk = chunk
        self.gain = chunk**0.5  # λ_t = √g_t (§2.3.3)
        self.router = nn.Linear(dim, chunk)

    def forward(self, z: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        beta = torch.softmax(self.router(z).float(), dim=-1).to(z.dtype)  # Eq. (21): [B, T, g]
        weight = beta.gather(-1, rho[None, :, None].expand(z.shape[0], -1, 1))  # β_{π(i), ρ(i)}
        return self.gain * weight * z  # Eq. (19)


def build_up(kind: str, dim: int, chunk: int) -> nn.Module:
    """``uniform`` or ``router``; at g = 1 both are the identity, so no router is built."""
    if kind == "router" and chunk > 1:
        return AllocationRouter(dim, chunk)
    return UniformBroadcast(chunk)
