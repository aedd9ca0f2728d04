"""The diagonal-decay op on flash-linear-attention's Triton kernels (CUDA only).

One call for every decay shape, same arguments and results as the PyTorch ops:
log_alpha None -> ``fla.ops.linear_attn`` (``normalize=False``), [B, T, H] ->
``fla.ops.simple_gla`` (``g``), [B, T, H, K] -> ``fla.ops.gla`` (``g`` / ``gk``). The
state layout is fla's default [B, H, K, V] (``state_v_first=False``), the same as ours,
so states move between backends unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch


def fla_decay(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_alpha: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    recurrent: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``recurrent``: fla's fused recurrent kernel (decoding) instead of the chunked one."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if log_alpha is None:
        from fla.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn

        fn = fused_recurrent_linear_attn if recurrent else chunk_linear_attn
        return fn(q=q, k=k, v=v, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, normalize=False)
    if log_alpha.dim() == 3:
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

        fn = fused_recurrent_simple_gla if recurrent else chunk_simple_gla
        return fn(q=q, k=k, v=v, g=log_alpha, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state)
    from fla.ops.gla import chunk_gla, fused_recurrent_gla

    if recurrent:
        return fused_recurrent_gla(q=q, k=k, v=v, gk=log_alpha, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state)
    return chunk_gla(q=q, k=k, v=v, g=log_alpha, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state)
