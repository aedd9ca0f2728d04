"""Up-scaling operators S↑ (spiralformer.txt §2.3.3): u_i = λ_t β_{π(i),ρ(i)} ẑ_{π(i)}, Eq. (19).

Both take the latents of m chunks ẑ [B, m, d] and return the update of every slot of those
chunks, u [B, m, g, d] with u[:, j, ρ] = λ_t β_{j,ρ} ẑ_j: slot ρ of chunk j is the position
with π(i) = j and ρ(i) = ρ (Eq. 12), so the caller lays the chunks out as a sequence by a
reshape and places it with the causal shift (``looplm.resolution.recursion``). β_j depends
on ẑ_j alone (Eq. 20-21), so it is computed once per chunk, not once per position.
λ_t = √g_t calibrates the update magnitude across chunk sizes.
"""

from __future__ import annotations

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost, module_cost


class UniformBroadcast(nn.Module):
    """β_{j,ρ} = 1/g: u_i = (λ_t / g_t) ẑ_{π(i)}, Eq. (20). Returns an expanded view over the
    g slots; at g = 1 (a shift-only iteration) λ/g = 1 and ẑ passes unchanged."""

    def __init__(self, chunk: int):
        super().__init__()
        self.chunk = chunk
        self.gain = chunk**0.5  # λ_t = √g_t (§2.3.3)

    def extra_repr(self) -> str:
        return f"chunk={self.chunk}, gain={self.gain:g}"

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        B, m, d = z.shape
        u = z if self.chunk == 1 else z * (self.gain / self.chunk)  # Eq. (20)
        return u[:, :, None].expand(B, m, self.chunk, d)

    def fused(self, z: torch.Tensor, front: int, skip: int, length: int) -> torch.Tensor:
        """:meth:`forward` placed by the causal shift (Eq. 22, g > 1) as one Triton kernel
        forward and one backward, as :meth:`AllocationRouter.fused` places its own."""
        from looplm.ops.resolution_triton import FusedAllocate

        return FusedAllocate.apply(z, None, None, self.chunk, self.gain, front, skip, length)

    def flop_cost(self, call: Call) -> Cost:
        """Eq. (20): (λ/g) ẑ once per chunk latent (none at g = 1), then broadcast to its g slots."""
        return Cost(state=call.rows * call.width if self.chunk > 1 else 0)


class AllocationRouter(nn.Module):
    """β_j = softmax(B(ẑ_j)) ∈ R^g, Eq. (21); ``router`` is the iteration's B^(t): d -> g."""

    def __init__(self, dim: int, chunk: int):
        super().__init__()
        self.chunk = chunk
        self.gain = chunk**0.5  # λ_t = √g_t (§2.3.3)
        self.router = nn.Linear(dim, chunk)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        beta = torch.softmax(self.router(z).float(), dim=-1).to(z.dtype)  # Eq. (21): [B, m, g], one per chunk
        # Eq. (19), an elementwise product (not a matmul: autocast would round it to bf16)
        return (self.gain * beta)[..., None] * z[:, :, None, :]  # [B, m, g, d]

    def fused(self, z: torch.Tensor, front: int, skip: int, length: int) -> torch.Tensor:
        """:meth:`forward` placed by the causal shift (Eq. 22), as one Triton kernel forward
        and one backward (:mod:`looplm.ops.resolution_triton`): ũ [B, length, d] with rows
        r < ``front`` zero and row r >= front slot ``skip`` + r − front of the chunk grid, what
        reshaping, cropping and padding :meth:`forward`'s output gives, at float32 rounding."""
        from looplm.ops.resolution_triton import FusedAllocate

        return FusedAllocate.apply(z, self.router.weight, self.router.bias, self.chunk, self.gain, front, skip,
                                   length)

    def flop_cost(self, call: Call) -> Cost:
        """Eq. (21): the router B^(t) (d -> g) once per chunk latent (``call.rows`` of them), then
        λ·β (g per chunk) and β_ρ·ẑ for every slot (g·d per chunk), Eq. (19)."""
        return module_cost(self.router, call) + Cost(state=call.rows * self.chunk * (1 + call.width))


def build_up(kind: str, dim: int, chunk: int) -> nn.Module:
    """``uniform`` or ``router``; at g = 1 both are the identity, so no router is built."""
    if kind == "router" and chunk > 1:
        return AllocationRouter(dim, chunk)
    return UniformBroadcast(chunk)
