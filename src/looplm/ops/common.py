"""What every recurrent op family shares: the input contract and the accumulation dtype."""

from __future__ import annotations

from typing import Optional

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs, float64 stays float64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def check_recurrent_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
) -> None:
    """Raise ValueError unless q, k [B, T, H, K], v [B, T, H, V], log_alpha None / [B, T, H] /
    [B, T, H, K] and initial_state None / [B, H, K, V]."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if log_alpha is not None and log_alpha.shape not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"log_alpha must be None, [B, T, H] or [B, T, H, K], got {tuple(log_alpha.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [B, H, K, V] = {(B, H, K, v.shape[-1])}, got {tuple(initial_state.shape)}"
        )
