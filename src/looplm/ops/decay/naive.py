"""The diagonal-decay linear-attention recurrence, step by step: the reference.

    S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ,    o_t = S_tᵀ (scale · q_t)        (LT2 Table 1)

one state S ∈ R^{K×V} per (batch row, head). α_t is given in log space, ``log_alpha``:
[B, T, H, K] for a diagonal (per key channel) decay (GLA, HGRN2), [B, T, H] for a
scalar decay per head (RetNet, Mamba2), or None for α = 1 (linear attention). Every
fast form in this package (``chunk.py``, ``recurrent.py``, flash-linear-attention's
kernels) must equal this loop.
"""

from __future__ import annotations

from typing import Optional

import torch

from looplm.ops.common import accumulation_dtype
from looplm.ops.common import check_recurrent_inputs as check_inputs


def naive_recurrent_decay(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k: [B, T, H, K]; v: [B, T, H, V]; log_alpha: [B, T, H, K], [B, T, H] or None;
    scale: multiplies q (None: K^-1/2, as flash-linear-attention); initial_state:
    [B, H, K, V] (None: zeros). Returns o [B, T, H, V] in q's dtype and, when
    ``output_final_state``, S_T [B, H, K, V] in float32 (float64 for float64 inputs)."""
    check_inputs(q, k, v, log_alpha, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype, acc = q.dtype, accumulation_dtype(q.dtype)
    scale = K**-0.5 if scale is None else scale
    q, k, v = (x.to(acc) for x in (q, k, v))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)
    outputs = []
    for t in range(T):
        if log_alpha is not None:
            alpha = log_alpha[:, t].to(acc).exp()  # [B, H, K] or [B, H]
            S = S * (alpha[..., None] if log_alpha.dim() == 4 else alpha[..., None, None])
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]  # + k_t v_tᵀ
        outputs.append((S * (scale * q[:, t, :, :, None])).sum(-2))  # S_tᵀ q_t: [B, H, V]
    o = torch.stack(outputs, dim=1) if T else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S if output_final_state else None)
