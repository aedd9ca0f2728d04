"""The delta rule in chunkwise-parallel form (training): work and memory linear in T.

Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence
Length" §3 (WY representation, UT transform), with the gates of Gated DeltaNet (Yang et
al. 2025, §3.3) and Kimi Delta Attention (Kimi Linear, 2025); fla's
``naive_chunk_gated_delta_rule`` and ``naive_chunk_kda`` are the same algorithm written
with per-row loops.

Within a chunk of C positions starting from state S_0, with G_r = Σ_{s≤r} log α_s (scalar
or per key channel) and Γ_r = exp(G_r), the delta-corrected values
u_r = β_r (v_r - k_rᵀ Diag(α_r) S_{r-1}) solve the unit lower-triangular system

    (I + A) U = diag(β) V - diag(β) (K ⊙ Γ) S_0,   A_rs = β_r Σ_d k_rd k_sd Γ_rd / Γ_sd  (s < r)

so U = Ũ - W S_0 with Ũ = (I + A)⁻¹ diag(β) V and W = (I + A)⁻¹ diag(β) (K ⊙ Γ) (the UT
transform; one triangular solve for all chunks at once). Then

    O   = scale · [(Q ⊙ Γ) S_0 + (Q Kᵀ ⊙ decay)_{s≤r} U]
    S_C = Diag(Γ_C) S_0 + (K ⊙ Γ_C / Γ)ᵀ U

Substituting U, S_C = M S_0 + b with M = Diag(Γ_C) - (K ⊙ Γ_C/Γ)ᵀ W and
b = (K ⊙ Γ_C/Γ)ᵀ Ũ, so the only sequential part is one fused multiply-add per chunk
carrying S across chunks; everything else (scores, the solve, M, b, the outputs) is
batched over all chunks. Every exponent formed is ≤ 0, so no decay, however strong,
overflows, and memory is O(T · (C + K + V)) per head.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from looplm.ops.delta.naive import check_inputs, compute_dtype

#: Inputs shorter than a chunk use one chunk of the next power of two, at least this long.
MIN_CHUNK = 16


def chunk_size_rule(chunk_size: int) -> Optional[str]:
    """None when ``chunk_size`` suits :func:`chunk_delta_rule`, else what is allowed (the
    op and the mixer configs read this one rule)."""
    if chunk_size < MIN_CHUNK or chunk_size & (chunk_size - 1):
        return f"a power of two >= {MIN_CHUNK}"
    return None


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_alpha: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunkwise delta rule; equals :func:`~looplm.ops.delta.naive.naive_recurrent_delta_rule`.

    Args:
        q, k: [B, T, H, K] (the layers L2-normalise them; the op does not).
        v: [B, T, H, V].
        beta: [B, T, H].
        log_alpha: log α_t — None (DeltaNet), [B, T, H] (GDN) or [B, T, H, K] (KDA); ≤ 0.
        scale: multiplies q; default K^-1/2.
        initial_state: S_0 [B, H, K, V]; default zeros.
        output_final_state: also return S_T.
        chunk_size: positions per chunk, a power of two >= 16 (shorter inputs use one chunk).

    Returns:
        o [B, T, H, V] in v's dtype; S_T [B, H, K, V] (float32, or float64 for float64
        inputs) when ``output_final_state``, else None.
    """
    check_inputs(q, k, v, beta, log_alpha, initial_state)
    allowed = chunk_size_rule(chunk_size)
    if allowed is not None:
        raise ValueError(f"chunk_size={chunk_size} is invalid: {allowed}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype, out_dtype = compute_dtype(v), v.dtype
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    if T == 0:
        return v.new_zeros(B, 0, H, V), (S if output_final_state else None)
    C = min(chunk_size, max(MIN_CHUNK, 1 << (T - 1).bit_length()))
    N = math.ceil(T / C)
    pad = N * C - T  # zero padding at the end: β = 0 and log α = 0 leave S unchanged

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.to(dtype).transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(B, H, N, C, *x.shape[3:])

    q, k, v, b = chunks(q) * scale, chunks(k), chunks(v), chunks(beta)
    kb = k * b[..., None]  # diag(β) K, [B, H, N, C, K]
    eye_K = torch.eye(K, dtype=dtype, device=q.device)
    if log_alpha is None:  # DeltaNet: Γ = 1
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        A, scores = kb @ k.transpose(-1, -2), (q @ k.transpose(-1, -2)).masked_fill(~causal, 0)  # [B, H, N, C, C]
        q_in, w_rhs, k_out, decay_C = q, kb, k, eye_K
    elif log_alpha.dim() == 3:  # GDN: one decay per head and position
        G = chunks(log_alpha).cumsum(-1)  # [B, H, N, C]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # Γ_r/Γ_s for s ≤ r, else 0
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, -math.inf).exp()
        A, scores = (kb @ k.transpose(-1, -2)) * decay, (q @ k.transpose(-1, -2)) * decay
        gamma = G.exp()[..., None]
        q_in, w_rhs = q * gamma, kb * gamma
        k_out = k * (G[..., -1:] - G).exp()[..., None]  # K ⊙ Γ_C/Γ
        decay_C = G[..., -1].exp()[..., None, None] * eye_K  # Diag(Γ_C), [B, H, N, K, K]
    else:  # KDA: one decay per key channel
        G = chunks(log_alpha).cumsum(-2)  # [B, H, N, C, K]
        A, scores = _channel_decayed_scores((kb, q), k, G)
        gamma = G.exp()
        q_in, w_rhs = q * gamma, kb * gamma
        k_out = k * (G[..., -1:, :] - G).exp()
        decay_C = torch.diag_embed(G[..., -1, :].exp())

    # UT transform for every chunk at once: [Ũ | W] = (I + A)⁻¹ [diag(β) V | diag(β) (K ⊙ Γ)]. The
    # solve reads only A's strictly lower triangle (unit diagonal: the I of I + A).
    rhs = torch.cat([v * b[..., None], w_rhs], dim=-1)  # [B, H, N, C, V + K]
    uw = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    u, w = uw.split([V, K], dim=-1)
    # S_next = Diag(Γ_C) S + (K ⊙ Γ_C/Γ)ᵀ (Ũ - W S) = M S + b: one fused multiply-add per chunk
    kt_uw = k_out.transpose(-1, -2) @ uw  # [B, H, N, K, V + K]
    M = (decay_C - kt_uw[..., V:]).flatten(0, 1)  # [B·H, N, K, K]
    b_next = kt_uw[..., :V].flatten(0, 1)  # [B·H, N, K, V]
    S = S.flatten(0, 1)
    starts = []
    for M_n, b_n in zip(M.unbind(1), b_next.unbind(1)):  # the only sequential part
        starts.append(S)
        S = torch.baddbmm(b_n, M_n, S)
    S0 = torch.stack(starts, dim=1).view(B, H, N, K, V)  # the state entering each chunk
    o = q_in @ S0 + scores @ (u - w @ S0)  # O = (Q ⊙ Γ) S_0 + scores · U,  U = Ũ - W S_0
    o = o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), (S.view(B, H, K, V) if output_final_state else None)


def _channel_decayed_scores(xs: tuple[torch.Tensor, ...], k: torch.Tensor, G: torch.Tensor) -> list[torch.Tensor]:
    """For each x in ``xs`` ([..., C, K]): [..., C, C] with entry (r, s) =
    Σ_d x_rd k_sd exp(G_rd - G_sd) for s ≤ r and 0 above the diagonal. k, G: [..., C, K],
    G the within-chunk cumulative log decay (non-increasing along C); C a power of two.

    The single factorisation (x_r ⊙ Γ_r)·(k_s / Γ_s) overflows for strong decays, and
    forming every pairwise decay costs C·K per position. Instead, binary blocks: for the
    pairs (r, s) whose highest differing bit is that of the block size 2b, s lies in the
    first half and r in the second half of one block of 2b positions, and their decay
    factors through G at the end of the first half, G_ref:
    exp(G_r - G_s) = exp(G_r - G_ref) · exp(G_ref - G_s), both exponents ≤ 0. Each level
    costs O(K) elementwise work per position plus a [b, K] @ [K, b] product per block
    (log2 C levels; fla's KDA kernel uses the same factoring across its 16-wide sub-chunks).
    """
    *lead, C, K = k.shape
    blocks = [(x * k).sum(-1)[..., :, None, None] for x in xs]  # level 0: the diagonal (no decay), [..., C, 1, 1]
    b = 1
    while b < C:
        n = C // (2 * b)
        G_first, G_second = G.reshape(*lead, n, 2, b, K).unbind(-3)  # [..., n, b, K] each
        G_ref = G_first[..., -1:, :]  # [..., n, 1, K], G at the end of each first half
        k_first = k.reshape(*lead, n, 2, b, K).unbind(-3)[0]
        right = (k_first * (G_ref - G_first).exp()).transpose(-1, -2)  # [..., n, K, b]
        row_decay = (G_second - G_ref).exp()  # [..., n, b, K]
        merged = []
        for x, D in zip(xs, blocks):
            cross = (x.reshape(*lead, n, 2, b, K).unbind(-3)[1] * row_decay) @ right  # [..., n, b (r), b (s)]
            D_first, D_second = D.reshape(*lead, n, 2, b, b).unbind(-3)
            top = F.pad(D_first, (0, b))  # nothing above the diagonal
            merged.append(torch.cat([top, torch.cat([cross, D_second], dim=-1)], dim=-2))  # [..., n, 2b, 2b]
        blocks = merged
        b *= 2
    return [D.reshape(*lead, C, C) for D in blocks]
