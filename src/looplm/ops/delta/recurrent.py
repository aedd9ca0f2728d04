"""The delta rule one position at a time with an O(K · V) state: decoding.

The rank-1 form of the naive recurrence (fla's ``fused_recurrent_*`` kernels):

    S ← Diag(α_t) S;   u_t = β_t (v_t - Sᵀ k_t);   S ← S + k_t u_tᵀ;   o_t = scale · Sᵀ q_t

:func:`delta_rule_update` is one step in six operators (two batched matrix-vector
products, the rank-1 update as one ``baddbmm``), the form the decoding step runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from looplm.ops.delta.naive import check_inputs, compute_dtype


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_alpha: Optional[torch.Tensor],
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One position. q, k: [B, H, K]; v: [B, H, V]; beta: [B, H]; log_alpha: None, [B, H]
    or [B, H, K]; state: S_{t-1} [B, H, K, V] in the compute dtype. Returns (o_t [B, H, V],
    S_t [B, H, K, V]), both in the state's dtype."""
    alpha = None if log_alpha is None else log_alpha.to(state.dtype).exp()
    return delta_rule_update(q, k, v, beta, alpha, state, scale)


def delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: Optional[torch.Tensor],
    alpha: Optional[torch.Tensor],
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One position with the decay given as α_t (not its log), in six operators: the
    decoding step. q, k: [B, H, K]; v: [B, H, V] (any strides); beta: [B, H] or None (β = 1);
    alpha: None (α = 1), [B, H] or [B, H, K]; state: S_{t-1} [B, H, K, V]. Returns (o_t
    [B, H, V], S_t [B, H, K, V]) in the state's dtype.

        S ← Diag(α_t) S;   u_t = β_t (v_t - Sᵀ k_t);   S ← S + k_t u_tᵀ;   o_t = scale · Sᵀ q_t
    """
    B, H, K, V = state.shape
    dtype = state.dtype
    if alpha is not None:
        alpha = alpha.to(dtype)
        state = state * (alpha[..., None, None] if alpha.dim() == 2 else alpha[..., None])
    S = state.reshape(B * H, K, V)
    k = k.to(dtype).reshape(B * H, 1, K)
    u = v.to(dtype) - torch.bmm(k, S).view(B, H, V)  # v_t - Sᵀ k_t
    if beta is not None:
        u = u * beta.to(dtype)[..., None]
    S = torch.baddbmm(S, k.transpose(1, 2), u.reshape(B * H, 1, V))  # S + k_t u_tᵀ
    # beta=0: the first argument only gives the shape; alpha applies the scale in the product
    o = torch.baddbmm(S[:, :1], q.to(dtype).reshape(B * H, 1, K), S, beta=0, alpha=scale)
    return o.view(B, H, V), S.view(B, H, K, V)


def recurrent_delta_rule(
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
    """:func:`delta_rule_step` over T positions; same arguments and returns as
    :func:`~looplm.ops.delta.naive.naive_recurrent_delta_rule` (q, k [B, T, H, K], v
    [B, T, H, V], beta [B, T, H], log_alpha None / [B, T, H] / [B, T, H, K], initial_state
    [B, H, K, V]) -> (o [B, T, H, V], S_T or None)."""
    check_inputs(q, k, v, beta, log_alpha, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = compute_dtype(v)
    S = q.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    o = []
    for t in range(T):
        o_t, S = delta_rule_step(
            q[:, t], k[:, t], v[:, t], beta[:, t], None if log_alpha is None else log_alpha[:, t], S, scale
        )
        o.append(o_t)
    out = torch.stack(o, dim=1) if o else v.new_zeros(B, 0, H, V, dtype=dtype)
    return out.to(v.dtype), (S if output_final_state else None)
