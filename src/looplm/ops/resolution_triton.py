"""SpiralFormer's down- and up-scaling (spiralformer.txt §2.3.2-2.3.4) as one Triton kernel
forward and one backward each: the learned operators and, with ``LEARNED`` off, the fixed
ones (the mean, Eq. 16, and the uniform broadcast, Eq. 20: α = β = 1/g, no parameters).

In PyTorch operators a compressed iteration's self-aggregation (Eq. 17-18) and allocation
router with the causal shift (Eq. 19, 21-22) launch 32 kernels forward and backward: a pad
for chunk 0's empty slots, the scorer and router matmuls, casts, the −∞ pad, two softmaxes,
the weighted sum, λβ, the broadcast product β ẑ, the shift's pad, and their gradients. Each
is a pass over [B, T, d] or smaller, so on a GPU the resolution change costs launches and
memory traffic, not FLOPs. Here one program takes one chunk through all of it:

* aggregate: the chunk's g token rows (read in place from the sequence: slot ρ of chunk j is
  row j·g + ρ − lead, Eq. 12), their scores A(h_i) = ⟨w, h_i⟩ + b, the softmax over the
  chunk's filled slots, z_j = Σ α_i h_i. Backward: the tokens' gradients and the scorer's
  weight and bias gradient of the chunk, summed over chunks by one ``sum``.
* allocate: β_j = softmax(B ẑ_j + b) (Eq. 21) once per chunk, u = λ β_{j,ρ} ẑ_j written
  straight to the shifted rows it lands on (Eq. 19, 22; rows before the shift are zeros).
  Backward: the latents' gradients and the router's, summed over chunks by one ``sum``.

Each is a ``torch.library`` custom operator (one dispatched operator per launch, kept whole
by ``torch.compile``), arithmetic in float32 whatever the storage dtype: equal to the
PyTorch operators at float32 rounding. A program holds a [g, d] tile in registers, so shapes
whose tile exceeds :data:`MAX_TILE` elements stay on the PyTorch operators
(:func:`fits`). Tested against them on CPU under ``TRITON_INTERPRET=1``
(tests/resolution/test_resolution_triton.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

#: the largest [chunk, d] tile (padded to powers of two) one program holds
MAX_TILE = 32768


def fits(chunk: int, d: int) -> bool:
    """Whether one chunk's [g, d] tile fits a program (else the PyTorch operators run).
    Plain integer arithmetic, so a traced forward reads it as a constant."""
    return (1 << (chunk - 1).bit_length()) * (1 << (d - 1).bit_length()) <= MAX_TILE


def _blocks(chunk: int, d: int) -> dict[str, int]:
    """Tile sizes, and warps enough that a program's [g, d] tile stays near 32 float32
    values per thread (4 warps up to 4096 elements, 16 from 16384 on)."""
    BG, BD = triton.next_power_of_2(chunk), triton.next_power_of_2(d)
    return dict(BG=BG, BD=BD, num_warps=max(4, min(16, BG * BD // 1024)))


@triton.jit
def _softmax(logits, valid):
    """Softmax of a [BG] vector over its ``valid`` entries (zero elsewhere), in float32."""
    logits = tl.where(valid, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 0))
    return p / tl.sum(p, 0)


@triton.jit
def _aggregate_forward_kernel(
    X, W, BIAS, Z, A,
    L, n, g, lead, d, x_b, x_t,
    LEARNED: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b·n + j
    b, j = pid // n, pid % n
    rho, dd = tl.arange(0, BG), tl.arange(0, BD)
    r = j * g + rho - lead  # the token in slot ρ of chunk j (Eq. 12)
    filled = (rho < g) & (r >= 0) & (r < L)
    dm = dd < d
    x = tl.load(X + b * x_b + r[:, None] * x_t + dd[None, :], mask=filled[:, None] & dm[None, :],
                other=0.0).to(tl.float32)
    if LEARNED:
        w = tl.load(W + dd, mask=dm, other=0.0).to(tl.float32)
        scores = tl.sum(x * w[None, :], 1) + tl.load(BIAS).to(tl.float32)  # A^(t)(h_i)
        alpha = _softmax(scores, filled)  # Eq. (17): over the chunk's filled slots
    else:  # Eq. (16): 1/g for every filled slot, even in a short first chunk
        alpha = tl.where(filled, 1.0 / g, 0.0)
    z = tl.sum(alpha[:, None] * x, 0)  # Eq. (18)
    tl.store(Z + pid * d + dd, z.to(Z.dtype.element_ty), mask=dm)
    tl.store(A + pid * g + rho, alpha, mask=rho < g)


@triton.jit
def _aggregate_backward_kernel(
    GZ, X, W, A, GX, GP,
    L, n, g, lead, d, x_b, x_t, chunks,
    LEARNED: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b·chunks + j; j >= n: the tokens after the last complete chunk
    b, j = pid // chunks, pid % chunks
    c = b * n + j
    rho, dd = tl.arange(0, BG), tl.arange(0, BD)
    r = j * g + rho - lead
    filled = (rho < g) & (r >= 0) & (r < L)
    dm = dd < d
    md = filled[:, None] & dm[None, :]
    cg, cd = (rho * 0 + j) < n, (dd * 0 + j) < n  # a complete chunk (as vectors: masks must be tensors)
    gz = tl.load(GZ + c * d + dd, mask=dm & cd, other=0.0).to(tl.float32)
    alpha = tl.load(A + c * g + rho, mask=(rho < g) & cg, other=0.0)
    gx = alpha[:, None] * gz[None, :]  # zeros for the trailing tokens
    if LEARNED:
        x = tl.load(X + b * x_b + r[:, None] * x_t + dd[None, :], mask=md & cg[:, None], other=0.0).to(tl.float32)
        w = tl.load(W + dd, mask=dm, other=0.0).to(tl.float32)
        g_alpha = tl.sum(x * gz[None, :], 1)
        g_score = alpha * (g_alpha - tl.sum(alpha * g_alpha, 0))  # softmax backward
        gx += g_score[:, None] * w[None, :]
        # this chunk's share of the scorer's gradients: [d weights, 1 bias] per chunk
        tl.store(GP + c * (d + 1) + dd, tl.sum(g_score[:, None] * x, 0), mask=dm & cd)
        tl.store(GP + c * (d + 1) + d + rho, tl.sum(g_score, 0) + rho * 0.0, mask=(rho == 0) & cg)
    tl.store(GX + (b * L + r)[:, None] * d + dd[None, :], gx.to(GX.dtype.element_ty), mask=md)


@triton.jit
def _allocate_forward_kernel(
    Z, W, BIAS, U, BETA,
    m, g, d, T, front, skip, zero_chunks, gain, z_b, z_m,
    LEARNED: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b·(m + zero_chunks) + p; p >= m: rows before the shift
    per = m + zero_chunks
    b, p = pid // per, pid % per
    rho, dd = tl.arange(0, BG), tl.arange(0, BD)
    dm, gm = dd < d, rho < g
    latent, latent_d = (rho * 0 + p) < m, (dd * 0 + p) < m  # a chunk to read (as vectors: masks must be tensors)
    # chunk p's slot ρ lands on row front + p·g + ρ − skip (Eq. 22); zero rows q·g + ρ < front
    r = tl.where(latent, front + p * g + rho - skip, (p - m) * g + rho)
    rows = gm & (r < T) & tl.where(latent, r >= front, r < front)
    z = tl.load(Z + b * z_b + p * z_m + dd, mask=dm & latent_d, other=0.0).to(tl.float32)
    if LEARNED:
        w = tl.load(W + rho[:, None] * d + dd[None, :], mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        logits = tl.sum(w * z[None, :], 1) + tl.load(BIAS + rho, mask=gm, other=0.0).to(tl.float32)
        beta = _softmax(logits, gm)  # Eq. (21)
    else:
        beta = tl.where(gm, 1.0 / g, 0.0)  # Eq. (20)
    u = (gain * beta)[:, None] * z[None, :]  # Eq. (19); zeros where no latent is read
    tl.store(U + (b * T + r)[:, None] * d + dd[None, :], u.to(U.dtype.element_ty), mask=rows[:, None] & dm[None, :])
    tl.store(BETA + (b * m + p) * g + rho, beta, mask=gm & latent)


@triton.jit
def _allocate_backward_kernel(
    GU, Z, W, BETA, GZ, GP,
    m, g, d, T, front, skip, gain, z_b, z_m,
    LEARNED: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b·m + j
    b, j = pid // m, pid % m
    rho, dd = tl.arange(0, BG), tl.arange(0, BD)
    dm, gm = dd < d, rho < g
    r = front + j * g + rho - skip
    rows = gm & (r >= front) & (r < T)
    gu = tl.load(GU + (b * T + r)[:, None] * d + dd[None, :], mask=rows[:, None] & dm[None, :],
                 other=0.0).to(tl.float32)
    beta = tl.load(BETA + pid * g + rho, mask=gm, other=0.0)
    gz = gain * tl.sum(beta[:, None] * gu, 0)
    if LEARNED:
        z = tl.load(Z + b * z_b + j * z_m + dd, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(W + rho[:, None] * d + dd[None, :], mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        g_beta = gain * tl.sum(gu * z[None, :], 1)
        g_logits = beta * (g_beta - tl.sum(beta * g_beta, 0))  # softmax backward
        gz += tl.sum(g_logits[:, None] * w, 0)
        # this chunk's share of the router's gradients: [g·d weights, g biases] per chunk
        share = GP + pid * (g * d + g)
        tl.store(share + rho[:, None] * d + dd[None, :], g_logits[:, None] * z[None, :],
                 mask=gm[:, None] & dm[None, :])
        tl.store(share + g * d + rho, g_logits, mask=gm)
    tl.store(GZ + pid * d + dd, gz.to(GZ.dtype.element_ty), mask=dm)


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("looplm::chunk_aggregate", mutates_args=())
def aggregate(tokens: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], lead: int,
              chunks: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-aggregation (Eq. 17-18) of the first ``chunks`` chunks of ``tokens`` [B, L, d]
    (chunk 0 starting ``lead`` slots before row 0, :func:`~looplm.resolution.downscale.chunk_grid`)
    with scorer weight [1, d] and bias [1]; without them (None) the mean, Eq. (16). Returns
    z [B, n, d] (tokens' dtype) and α [B, n, g] (float32, for the backward)."""
    B, L, d = tokens.shape
    tokens = _last_dim_dense(tokens)
    z = tokens.new_empty(B, chunks, d)
    alpha = tokens.new_empty(B, chunks, chunk, dtype=torch.float32)
    learned = weight is not None
    _aggregate_forward_kernel[(B * chunks,)](
        tokens, weight.contiguous() if learned else tokens, bias if learned else tokens, z, alpha,
        L, chunks, chunk, lead, d, tokens.stride(0), tokens.stride(1), LEARNED=learned, **_blocks(chunk, d))
    return z, alpha


@aggregate.register_fake
def _(tokens, weight, bias, lead, chunks, chunk):
    B, _, d = tokens.shape
    return tokens.new_empty(B, chunks, d), tokens.new_empty(B, chunks, chunk, dtype=torch.float32)


@torch.library.custom_op("looplm::chunk_aggregate_backward", mutates_args=())
def aggregate_backward(grad_z: torch.Tensor, tokens: torch.Tensor, weight: Optional[torch.Tensor],
                       alpha: torch.Tensor, lead: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the tokens [B, L, d] (zero after the last complete chunk) and each
    chunk's share of the scorer's [B·n, d + 1] (weight, bias; empty for the mean), from what
    the forward saved."""
    B, L, d = tokens.shape
    n, g = alpha.shape[1:]
    tokens = _last_dim_dense(tokens)
    g_tokens = tokens.new_empty(B, L, d)
    learned = weight is not None
    shares = alpha.new_empty(B * n, d + 1) if learned else alpha.new_empty(0)
    chunks = triton.cdiv(L + lead, g)  # every token's chunk, complete or not
    _aggregate_backward_kernel[(B * chunks,)](
        grad_z.contiguous(), tokens, weight.contiguous() if learned else tokens, alpha, g_tokens,
        shares if learned else alpha, L, n, g, lead, d, tokens.stride(0), tokens.stride(1), chunks,
        LEARNED=learned, **_blocks(g, d))
    return g_tokens, shares


@aggregate_backward.register_fake
def _(grad_z, tokens, weight, alpha, lead):
    B, L, d = tokens.shape
    shares = alpha.new_empty(B * alpha.shape[1], d + 1) if weight is not None else alpha.new_empty(0)
    return tokens.new_empty(B, L, d), shares


@torch.library.custom_op("looplm::chunk_allocate", mutates_args=())
def allocate(latents: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], chunk: int,
             gain: float, front: int, skip: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up-scaling (Eq. 19) of ``latents`` [B, m, d] over chunks of ``chunk`` slots with the
    allocation router's weight [g, d] and bias [g] (Eq. 21), or uniformly without them (None,
    Eq. 20), placed by the causal shift (Eq. 22): row r < ``front`` is zero, row r >= front
    is slot ``skip`` + r − front of the chunk grid. Returns ũ [B, length, d] (latents' dtype)
    and β [B, m, g] (float32, for the backward)."""
    B, m, d = latents.shape
    latents = _last_dim_dense(latents)
    u = latents.new_empty(B, length, d)
    beta = latents.new_empty(B, m, chunk, dtype=torch.float32)
    zero_chunks = triton.cdiv(min(front, length), chunk)
    learned = weight is not None
    _allocate_forward_kernel[(B * (m + zero_chunks),)](
        latents, weight.contiguous() if learned else latents, bias if learned else latents, u, beta,
        m, chunk, d, length, front, skip, zero_chunks, gain, latents.stride(0), latents.stride(1),
        LEARNED=learned, **_blocks(chunk, d))
    return u, beta


@allocate.register_fake
def _(latents, weight, bias, chunk, gain, front, skip, length):
    B, m, d = latents.shape
    return latents.new_empty(B, length, d), latents.new_empty(B, m, chunk, dtype=torch.float32)


@torch.library.custom_op("looplm::chunk_allocate_backward", mutates_args=())
def allocate_backward(grad_u: torch.Tensor, latents: torch.Tensor, weight: Optional[torch.Tensor],
                      beta: torch.Tensor, gain: float, front: int, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the latents [B, m, d] and each chunk's share of the router's
    [B·m, g·d + g] (weight rows, then biases; empty when uniform), from what the forward saved."""
    B, m, d = latents.shape
    g = beta.shape[-1]
    latents = _last_dim_dense(latents)
    g_latents = latents.new_empty(B, m, d)
    learned = weight is not None
    shares = beta.new_empty(B * m, g * d + g) if learned else beta.new_empty(0)
    _allocate_backward_kernel[(B * m,)](
        grad_u.contiguous(), latents, weight.contiguous() if learned else latents, beta, g_latents,
        shares if learned else beta, m, g, d, grad_u.shape[1], front, skip, gain, latents.stride(0),
        latents.stride(1), LEARNED=learned, **_blocks(g, d))
    return g_latents, shares


@allocate_backward.register_fake
def _(grad_u, latents, weight, beta, gain, front, skip):
    B, m, d = latents.shape
    g = beta.shape[-1]
    return latents.new_empty(B, m, d), beta.new_empty(B * m, g * d + g) if weight is not None else beta.new_empty(0)


def _parameter_grads(shares: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]
                     ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A linear layer's weight and bias gradients from the per-chunk shares the backward
    kernels write ([chunks, weight.numel() + bias.numel()]: weights, then biases): one ``sum``
    (none for the fixed operators, which have no parameters)."""
    if weight is None:
        return None, None
    total, size = shares.sum(dim=0), weight.numel()
    return total[:size].view_as(weight).to(weight.dtype), total[size:].view_as(bias).to(bias.dtype)


class FusedAggregate(torch.autograd.Function):
    """S↓ through :func:`aggregate` and :func:`aggregate_backward`: tokens [B, L, d], the
    scorer's weight [1, d] and bias [1] (self-aggregation) or None (the mean), ``lead``, n
    chunks of g."""

    @staticmethod
    def forward(ctx, tokens, weight, bias, lead, chunks, chunk):
        z, alpha = aggregate(tokens, weight, bias, lead, chunks, chunk)
        ctx.lead = lead
        ctx.save_for_backward(tokens, weight, bias, alpha)
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_z):
        tokens, weight, bias, alpha = ctx.saved_tensors
        g_tokens, shares = aggregate_backward(grad_z, tokens, weight, alpha, ctx.lead)
        return g_tokens, *_parameter_grads(shares, weight, bias), None, None, None


class FusedAllocate(torch.autograd.Function):
    """S↑ placed by the shift (Eq. 19-22) through :func:`allocate` and
    :func:`allocate_backward`: latents [B, m, d], the router's weight [g, d] and bias [g]
    (allocation router) or None (uniform), the chunk size g, the gain λ and the placement
    (front, skip, length)."""

    @staticmethod
    def forward(ctx, z, weight, bias, chunk, gain, front, skip, length):
        u, beta = allocate(z, weight, bias, chunk, gain, front, skip, length)
        ctx.placement = gain, front, skip
        ctx.save_for_backward(z, weight, bias, beta)
        return u

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_u):
        z, weight, bias, beta = ctx.saved_tensors
        g_z, shares = allocate_backward(grad_u, z, weight, beta, *ctx.placement)
        return g_z, *_parameter_grads(shares, weight, bias), None, None, None, None, None
