"""Chunkwise-parallel form of the diagonal-decay recurrence, for training.

The sequence is cut into chunks of C positions (the last one padded with k = 0 and
log α = 0, which leaves the state unchanged). With S_0 the state entering a chunk and
g_s = log α_s:

    o_i = (q_i ⊙ e^{Σ_{s≤i} g_s})ᵀ S_0 + Σ_{j≤i} (q_i ⊙ e^{Σ_{j<s≤i} g_s})ᵀ k_j · v_j  (inter + intra)
    S_C = Diag(e^{Σ_s g_s}) S_0 + Σ_j (k_j ⊙ e^{Σ_{s>j} g_s}) v_jᵀ                       (next chunk's S_0)

All chunks' intra terms are batched matmuls; only the state hand-over S_0 → S_C runs as
a Python loop over chunks (T / C steps, each one multiply-add). Memory is linear in T:
the largest tensors are [.., C, C] per chunk, never T × T.

Numerical stability: every exponent is a sum of log α over a segment of positions
(so ≤ 0: nothing overflows however strong the decay), and every such sum is computed
as a sum, never as the difference b_i - b_j of two cumulative sums, which loses all
precision in float32 once |b| is large. A scalar decay gives the C × C matrix of segment
sums directly (Mamba2's ``segsum``). A diagonal decay cannot in general be factored as
(q e^{b}) (k e^{-b})ᵀ without e^{-b} overflowing, so the chunk uses flash-linear-attention's
secondary chunking (fla/ops/gla/chunk.py): sub-chunks of 16 positions; between
sub-chunks J < I the decay splits into three segment sums (the rest of J, the sub-chunks
in between, the start of I), all ≤ 0, and the scores are a matmul; inside a sub-chunk the
decays are applied element by element. Where the decay over a whole chunk (or over every
sub-chunk) is mild, at least e^{-20} — the usual case for GLA's normalised gates — the
factored matmul is safe and exact to rounding there and replaces the element-by-element
work (:data:`SAFE_LOG_DECAY`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from looplm.ops.decay.naive import accumulation_dtype, check_inputs

#: Sub-chunk length of the secondary chunking for diagonal decays (fla's BC).
SUB_CHUNK = 16

#: A diagonal decay whose log over a span (a chunk, else each sub-chunk) stays above
#: -SAFE_LOG_DECAY everywhere is factored over that span as (q e^{P}) (k e^{-P})ᵀ with
#: P = Σ_{s≤i} g_s from the span's start: e^{-P} <= e^{20} cannot overflow float32, and
#: P's rounding error (≈ 20 · 2^-24) stays far below the test tolerances. Stronger decays
#: take the exact element-by-element path. The three paths agree to rounding.
SAFE_LOG_DECAY = 20.0


def chunk_size_rule(chunk_size: int) -> Optional[str]:
    """None when ``chunk_size`` suits :func:`chunk_decay` (any T, any C), else what is
    allowed (the op and the mixer configs read this one rule)."""
    return None if chunk_size >= 1 else "an integer >= 1"


def chunk_decay(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Same arguments and results as :func:`~looplm.ops.decay.naive.naive_recurrent_decay`
    (q, k [B, T, H, K]; v [B, T, H, V]; log_alpha [B, T, H, K], [B, T, H] or None;
    initial_state [B, H, K, V]), plus ``chunk_size`` C; any T, not only multiples of C."""
    check_inputs(q, k, v, log_alpha, initial_state)
    allowed = chunk_size_rule(chunk_size)
    if allowed is not None:
        raise ValueError(f"chunk_size={chunk_size} is invalid: {allowed}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype, acc = q.dtype, accumulation_dtype(q.dtype)
    scale = K**-0.5 if scale is None else scale
    state = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
    if T == 0:
        return v.new_zeros(B, 0, H, V, dtype=out_dtype), (state if output_final_state else None)
    C = chunk_size
    N = -(-T // C)  # number of chunks
    pad = N * C - T

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B, H, N, C, D]
        x = F.pad(x.to(acc), (0, 0, 0, 0, 0, pad))
        return x.view(B, N, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v = chunks(q) * scale, chunks(k), chunks(v)
    if log_alpha is None:  # α = 1
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        o = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0) @ v  # intra: [B, H, N, C, V]
        q_in, k_out, carry = q, k, None
    elif log_alpha.dim() == 3:  # one scalar per head
        g = F.pad(log_alpha.to(acc), (0, 0, 0, pad)).view(B, N, C, H).permute(0, 3, 1, 2)  # [B, H, N, C]
        prefix = _inclusive_prefix(g, channels=False)  # Σ_{s≤i}
        decay = _segment_sums(g, channels=False).exp()  # e^{Σ_{j<s≤i}}, 0 above the diagonal: [B, H, N, C, C]
        o = ((q @ k.transpose(-1, -2)) * decay) @ v
        q_in = q * prefix.exp()[..., None]
        k_out = k * _exclusive_suffix(g, channels=False).exp()[..., None]
        carry = prefix[..., -1].exp()[..., None, None]  # decay over the whole chunk: [B, H, N, 1, 1]
    else:  # one per key channel
        g = chunks(log_alpha)  # [B, H, N, C, K]
        prefix = _inclusive_prefix(g, channels=True)
        o = _intra_diagonal(q, k, v, g, prefix)
        q_in = q * prefix.exp()
        k_out = k * _exclusive_suffix(g, channels=True).exp()
        carry = prefix[..., -1, :].exp()[..., None]  # [B, H, N, K, 1]

    kv = k_out.transpose(-1, -2) @ v  # each chunk's addition to the state: [B, H, N, K, V]
    # unbind once, not kv[:, :, n] per step: each indexing's backward would materialise a
    # zero [B, H, N, K, V] gradient, O(N²·K·V) over the loop (quadratic in T)
    adds = kv.unbind(2)
    decays = [None] * N if carry is None else carry.unbind(2)
    entering = []
    for n in range(N):  # hand the state over from chunk to chunk
        entering.append(state)
        state = (state if decays[n] is None else state * decays[n]) + adds[n]
    o = o + q_in @ torch.stack(entering, dim=2)  # inter: [B, H, N, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), (state if output_final_state else None)


def _segment_sums(g: torch.Tensor, channels: bool) -> torch.Tensor:
    """Σ_{j<s≤i} g_s for every i ≥ j, -inf for j > i (so that exp gives 0 there).

    g: [.., C] -> [.., C_i, C_j]; with ``channels``, g: [.., C, K] -> [.., C_i, C_j, K].
    One matmul with the 0/1 matrix [j < s ≤ i]: sums of same-signed terms, exact to
    rounding, and a single GEMM instead of a cumsum over a [C, C] expansion."""
    C = g.shape[-2] if channels else g.shape[-1]
    idx = torch.arange(C, device=g.device)
    i, j, s = idx[:, None, None], idx[None, :, None], idx[None, None, :]
    segment = ((j < s) & (s <= i)).to(g.dtype).reshape(C * C, C)  # [(i, j), s]
    causal = (idx[:, None] >= idx[None, :]).reshape(C * C)
    if channels:  # [.., C, K] -> [.., C*C, K]
        sums = torch.where(causal[:, None], segment @ g, float("-inf"))
        return sums.reshape(*g.shape[:-2], C, C, g.shape[-1])
    sums = torch.where(causal, g @ segment.T, float("-inf"))  # [.., C*C]
    return sums.reshape(*g.shape[:-1], C, C)


def _exclusive_suffix(g: torch.Tensor, channels: bool) -> torch.Tensor:
    """Σ_{s>j} g_s for every j (0 at the last position), along the position axis of
    g [.., C] (or [.., C, K] with ``channels``); a matmul with the 0/1 matrix [s > j]."""
    C = g.shape[-2] if channels else g.shape[-1]
    idx = torch.arange(C, device=g.device)
    later = (idx[None, :] > idx[:, None]).to(g.dtype)  # [j, s]
    return later @ g if channels else g @ later.T


def _inclusive_prefix(g: torch.Tensor, channels: bool) -> torch.Tensor:
    """Σ_{s≤i} g_s (cumsum along the position axis), as a matmul with [s ≤ i]."""
    C = g.shape[-2] if channels else g.shape[-1]
    upto = torch.ones(C, C, dtype=g.dtype, device=g.device).tril()  # [i, s]
    return upto @ g if channels else g @ upto.T


def _intra_diagonal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, prefix: torch.Tensor
) -> torch.Tensor:
    """Σ_{j≤i} (q_i ⊙ e^{Σ_{j<s≤i} g_s})ᵀ k_j · v_j inside each chunk.

    q, k, g, prefix (Σ_{s≤i} g_s inside the chunk): [.., C, K]; v: [.., C, V] -> [.., C, V].
    Where the decay over a span is at most e^{-SAFE_LOG_DECAY}, the span is factored as
    (q e^{P}) (k e^{-P})ᵀ, a matmul; otherwise by element (see :data:`SAFE_LOG_DECAY`)."""
    *lead, C, K = q.shape
    V = v.shape[-1]
    if prefix[..., -1, :].min() >= -SAFE_LOG_DECAY:  # mild decay over every whole chunk
        scores = (q * prefix.exp()) @ (k * (-prefix).exp()).transpose(-1, -2)  # [.., C_i, C_j]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        return torch.where(causal, scores, 0.0) @ v
    S = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    M = C // S
    qs, ks, gs = (x.reshape(*lead, M, S, K) for x in (q, k, g))
    start = _inclusive_prefix(gs, channels=True)  # Σ over the sub-chunk's start up to i: [.., M, S, K]
    q_rel = qs * start.exp()
    # inside each sub-chunk: factored where its decay is mild (-start clamped so the other
    # sub-chunks cannot overflow), then the strongly decaying ones redone element by element
    scores = q_rel @ (ks * (-start).clamp(max=SAFE_LOG_DECAY).exp()).transpose(-1, -2)  # [.., M, S_i, S_j]
    scores = torch.where(torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), scores, 0.0)
    strong = start[..., -1, :].amin(-1) < -SAFE_LOG_DECAY  # [.., M]
    if strong.any():
        scores = scores.reshape(-1, S, S)
        rows = strong.reshape(-1).nonzero().squeeze(-1)
        qx, kx, gx = (x.reshape(-1, S, K)[rows] for x in (qs, ks, gs))
        decay = _segment_sums(gx, channels=True).exp()  # [n, S_i, S_j, K]
        scores = scores.index_put((rows,), (qx[:, :, None, :] * kx[:, None, :, :] * decay).sum(-1))
        scores = scores.reshape(*lead, M, S, S)
    o = (scores @ v.reshape(*lead, M, S, V)).reshape(*lead, C, V)
    if M > 1:  # between sub-chunks J < I: e^{rest of J} · e^{sub-chunks between} · e^{start of I}
        totals = _segment_sums(gs.sum(-2), channels=True)  # [.., I, J, K]: Σ_{J<L≤I} totals_L
        between = torch.cat([torch.full_like(totals[..., :1, :, :], float("-inf")), totals[..., :-1, :, :]], -3)
        rest_of_j = _exclusive_suffix(gs, channels=True)
        k_rel = rest_of_j[..., None, :, :, :] + between[..., :, :, None, :]  # [.., I, J, S, K]
        k_rel = (ks[..., None, :, :, :] * k_rel.exp()).reshape(*lead, M, M * S, K)
        o = o + (q_rel @ k_rel.transpose(-1, -2)).reshape(*lead, C, C) @ v
    return o
