"""Step-by-step form of the diagonal-decay recurrence, for decoding: O(1) state per step.

``decay_step`` advances one position; ``recurrent_decay`` runs it over any T (T = 1 when
decoding) with the same arguments and results as the naive reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from looplm.ops.decay.naive import accumulation_dtype, check_inputs


def decay_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: Optional[torch.Tensor],
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One position. q, k: [B, H, K]; v: [B, H, V]; log_alpha: [B, H, K], [B, H] or None;
    state: S_{t-1} [B, H, K, V] (float32/64). Returns (o_t [B, H, V], S_t), in state's dtype:

        S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ,   o_t = S_tᵀ (scale · q_t)
    """
    B, H, K, V = state.shape
    dtype = state.dtype
    if log_alpha is not None:
        alpha = log_alpha.to(dtype).exp()
        state = state * (alpha[..., None] if alpha.dim() == 3 else alpha[..., None, None])
    # batched over (B, H): the rank-1 write as one baddbmm, the read with its scale as another
    S = torch.baddbmm(state.reshape(B * H, K, V), k.to(dtype).reshape(B * H, K, 1), v.to(dtype).reshape(B * H, 1, V))
    o = torch.baddbmm(S[:, :1], q.to(dtype).reshape(B * H, 1, K), S, beta=0, alpha=scale)  # beta=0: shape only
    return o.view(B, H, V), S.view(B, H, K, V)


def recurrent_decay(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Same arguments and results as :func:`~looplm.ops.decay.naive.naive_recurrent_decay`;
    one :func:`decay_step` per position."""
    check_inputs(q, k, v, log_alpha, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    acc = accumulation_dtype(q.dtype)
    scale = K**-0.5 if scale is None else scale
    state = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
    outputs = []
    for t in range(T):
        o, state = decay_step(q[:, t], k[:, t], v[:, t], None if log_alpha is None else log_alpha[:, t], state, scale)
        outputs.append(o)
    if T == 1:  # decoding: no stack
        o = outputs[0][:, None]
    else:
        o = torch.stack(outputs, dim=1) if T else v.new_zeros(B, 0, H, V)
    return o.to(q.dtype), (state if output_final_state else None)
