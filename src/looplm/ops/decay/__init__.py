"""The diagonal-decay linear-attention family: LA, RetNet, GLA, HGRN2, Mamba2.

    S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ,      o_t = S_tᵀ (scale · q_t)

(LT2 Table 1; flash-linear-attention's ``fla.ops.{linear_attn,retention,simple_gla,gla}``).
The decay is given in log space, ``log_alpha`` = log α_t: None (α = 1, LA), ``[B, T, H]``
(a scalar per head: RetNet's fixed γ_h, Mamba2's Δ_t·A_h) or ``[B, T, H, K]`` (one per key
channel: GLA, HGRN2); fla calls it ``g`` / ``gk``.

* :func:`naive_recurrent_decay` — the recurrence as written, the reference;
* :func:`chunk_decay` — chunkwise-parallel, for training;
* :func:`recurrent_decay` / :func:`decay_step` — O(1)-state decoding;
* :func:`fla_decay` — flash-linear-attention's Triton kernels for the same op (CUDA).
"""

from looplm.ops.decay.chunk import chunk_decay, chunk_size_rule
from looplm.ops.decay.fla import fla_decay
from looplm.ops.decay.naive import naive_recurrent_decay
from looplm.ops.decay.recurrent import decay_step, recurrent_decay

__all__ = ["chunk_decay", "chunk_size_rule", "decay_step", "fla_decay", "naive_recurrent_decay", "recurrent_decay"]
