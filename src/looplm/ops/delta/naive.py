"""The delta rule as written: one position at a time, with the transition matrix built
explicitly. The reference that the chunkwise and recurrent forms are tested against.

    S_t = A_t S_{t-1} + β_t k_t v_tᵀ,   A_t = (I - β_t k_t k_tᵀ) Diag(α_t),   o_t = scale · S_tᵀ q_t

This is LT2 Table 1 (DeltaNet α = 1; GDN α_t scalar; KDA α_t ∈ [0, 1]^K) and the order of
flash-linear-attention's references (``fla.ops.kda.naive.naive_recurrent_kda`` decays S,
then applies the delta update). LT2 §2 writes A_t = Diag(α_t)(I - β_t k_t k_tᵀ) for KDA;
the two orders agree for scalar α and differ for channel-wise α, and the fla/Kimi order
is the one kept here.
"""

from __future__ import annotations

from typing import Optional

import torch

from looplm.ops.common import accumulation_dtype, check_recurrent_inputs


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_alpha: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
) -> None:
    """The shared recurrent-op contract plus beta [B, T, H]; raise ValueError otherwise."""
    check_recurrent_inputs(q, k, v, log_alpha, initial_state)
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")


def compute_dtype(v: torch.Tensor) -> torch.dtype:
    """float32, or float64 when the inputs are float64 (gradient checks)."""
    return accumulation_dtype(v.dtype)


def naive_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_alpha: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The reference recurrence, O(T · K² · V).

    Args:
        q, k: [B, T, H, K] (the layers L2-normalise them; the op does not).
        v: [B, T, H, V].
        beta: [B, T, H], the delta-rule step size β_t.
        log_alpha: log α_t — None (α = 1), [B, T, H] (per head) or [B, T, H, K] (per key channel).
        scale: multiplies q; default K^-1/2 (as fla).
        initial_state: S_0, [B, H, K, V]; default zeros.
        output_final_state: also return S_T.

    Returns:
        o [B, T, H, V] in v's dtype; S_T [B, H, K, V] (float32, or float64 for float64
        inputs) when ``output_final_state``, else None.
    """
    check_inputs(q, k, v, beta, log_alpha, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = compute_dtype(v)
    scale = K**-0.5 if scale is None else scale
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    eye = torch.eye(K, dtype=dtype, device=q.device)
    o = []
    for t in range(T):
        k_t, b_t = k[:, t], beta[:, t, :, None, None]  # [B, H, K], [B, H, 1, 1]
        if log_alpha is not None:
            alpha = log_alpha[:, t].to(dtype).exp()  # [B, H] or [B, H, K]
            alpha = alpha[..., None, None] if alpha.dim() == 2 else alpha[..., :, None]
            S = alpha * S  # Diag(α_t) S_{t-1}
        householder = eye - b_t * k_t[..., :, None] * k_t[..., None, :]  # I - β_t k_t k_tᵀ, [B, H, K, K]
        S = householder @ S + b_t * k_t[..., :, None] * v[:, t, :, None, :]  # LT2 Table 1
        o.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))  # o_t = S_tᵀ q_t
    out = torch.stack(o, dim=1) if o else v.new_zeros(B, 0, H, V, dtype=dtype)
    return out.to(v.dtype), (S if output_final_state else None)
