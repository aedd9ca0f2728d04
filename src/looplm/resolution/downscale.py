"""Down-scaling operators S↓ (spiralformer.txt §2.3.2): chunk tokens -> one latent per chunk.

Both take the tokens of whole chunks laid out on a grid, x [B, n, g, d] (:func:`chunk_grid`,
a reshape of the sequence), and ``lead``, the empty slots at the start of chunk 0 (ω > 0
makes chunk 0 start at grid slot ω; those slots hold zeros), and return z [B, n, d].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost, module_cost


def chunk_grid(tokens: torch.Tensor, lead: int, chunks: int, chunk: int) -> torch.Tensor:
    """The first ``chunks`` chunks of ``tokens`` [B, L, d] as a grid [B, n, g, d]: slot
    (j, ρ) holds grid index j·g + ρ = the token ``lead`` places earlier (Eq. 12 with
    ``lead`` = ω for chunk 0 of the sequence). A view when ``lead`` = 0, else one pad that
    writes the ``lead`` zeros and crops the tokens after the last complete chunk."""
    B, L, d = tokens.shape
    n, g = chunks, chunk
    if lead == 0:
        return tokens[:, : n * g].reshape(B, n, g, d)
    return F.pad(tokens, (0, 0, lead, n * g - lead - L)).view(B, n, g, d)  # [B, n·g, d] -> [B, n, g, d]


class MeanPool(nn.Module):
    """z_j = (1/g) Σ_{i ∈ I_j} h_i, Eq. (16). Divides by g even for a short first chunk,
    exactly as the equation writes it (Algorithm 2's zero-initialised buffer does the same):
    the empty slots of the grid are zeros, so the sum runs over I_j. At g = 1 the identity."""

    def forward(self, x: torch.Tensor, lead: int) -> torch.Tensor:
        g = x.shape[2]
        return x[:, :, 0] if g == 1 else x.sum(dim=2) / g  # Eq. (16)

    def fused(self, tokens: torch.Tensor, lead: int, chunks: int, chunk: int) -> torch.Tensor:
        """:meth:`forward` of the first ``chunks`` chunks of ``tokens`` [B, L, d] (as
        :func:`chunk_grid` lays them out, g > 1) as one Triton kernel forward and one backward
        (:mod:`looplm.ops.resolution_triton`): the same z [B, n, d] at float32 rounding."""
        from looplm.ops.resolution_triton import FusedAggregate

        return FusedAggregate.apply(tokens, None, None, lead, chunks, chunk)

    def flop_cost(self, call: Call) -> Cost:
        return Cost(state=call.rows * call.width)  # Eq. (16): one add (and the 1/g scale) per token and channel


class SelfAggregation(nn.Module):
    """z_j = Σ_{i ∈ I_j} α_{j,i} h_i with α_j = softmax over the chunk of A(h_i), Eq. (17-18).

    ``scorer`` is the iteration's A^(t): d -> 1, one linear layer. The softmax runs over the
    chunk's positions only (Eq. 17): the ``lead`` empty slots of chunk 0 score −∞.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.scorer = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, lead: int) -> torch.Tensor:
        B, n, g, _ = x.shape
        scores = self.scorer(x).float().reshape(B, n * g)  # [B, n·g], one cast (softmax in fp32)
        if lead:  # the empty slots of chunk 0 take no weight
            scores = F.pad(scores[:, lead:], (lead, 0), value=float("-inf"))
        alpha = torch.softmax(scores.view(B, n, g), dim=-1).to(x.dtype)  # Eq. (17)
        return torch.einsum("bng,bngd->bnd", alpha, x)  # Eq. (18)

    def fused(self, tokens: torch.Tensor, lead: int, chunks: int, chunk: int) -> torch.Tensor:
        """:meth:`forward` of the first ``chunks`` chunks of ``tokens`` [B, L, d] (as
        :func:`chunk_grid` lays them out) as one Triton kernel forward and one backward
        (:mod:`looplm.ops.resolution_triton`): the same z [B, n, d] at float32 rounding."""
        from looplm.ops.resolution_triton import FusedAggregate

        return FusedAggregate.apply(tokens, self.scorer.weight, self.scorer.bias, lead, chunks, chunk)

    def flop_cost(self, call: Call) -> Cost:
        """Eq. (17-18): the scorer A^(t) (d -> 1) on every token, softmax over the chunk (left
        out like activations), then Σ_i α_i h_i: d MACs per token."""
        return module_cost(self.scorer, call) + Cost(mac=call.rows * call.width)


def build_down(kind: str, dim: int, chunk: int) -> nn.Module:
    """``mean`` or ``aggregate``; at g = 1 both are the identity, so no scorer is built."""
    if kind == "aggregate" and chunk > 1:
        return SelfAggregation(dim)
    return MeanPool()
