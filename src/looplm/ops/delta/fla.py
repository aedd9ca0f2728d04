"""The delta rule on flash-linear-attention's Triton kernels (CUDA only).

One call for every gate shape, same arguments and results as the PyTorch ops: log_alpha
None -> ``fla.ops.delta_rule``, [B, T, H] -> ``fla.ops.gated_delta_rule`` (``g``),
[B, T, H, K] -> ``fla.ops.kda`` (``g``). The state layout is fla's default [B, H, K, V],
the same as ours, so states move between backends unchanged.
"""

from __future__ import annotations

import torch


def fla_delta_rule(q, k, v, beta, log_alpha, initial_state, step: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same op through flash-linear-attention (CUDA): q, k (normalised) [B, T, H, K],
    v [B, T, H, V], beta [B, T, H], log_alpha None / [B, T, H] / [B, T, H, K] (fla's ``g``),
    initial_state [B, H, K, V] float32 or None. Returns (o [B, T, H, V], S_T float32)."""
    kwargs = dict(beta=beta.to(q.dtype), initial_state=initial_state, output_final_state=True)
    if log_alpha is None:
        from fla.ops.delta_rule import chunk_delta_rule as chunk
        from fla.ops.delta_rule import fused_recurrent_delta_rule as recurrent
    elif log_alpha.dim() == 3:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
        from fla.ops.gated_delta_rule import (
            fused_recurrent_gated_delta_rule as recurrent,
        )

        kwargs["g"] = log_alpha
    else:
        from fla.ops.kda import chunk_kda as chunk
        from fla.ops.kda import fused_recurrent_kda as recurrent

        kwargs["g"] = log_alpha
    o, S = (recurrent if step else chunk)(q=q, k=k, v=v, **kwargs)
    return o, S.float()
