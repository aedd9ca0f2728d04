"""The delta-rule family: DeltaNet, Gated DeltaNet (GDN) and Kimi Delta Attention (KDA).

    S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ,      o_t = scale · S_tᵀ q_t

(LT2 Table 1; flash-linear-attention's ``fla.ops.{delta_rule,gated_delta_rule,kda}``). The
gate is given in log space, ``log_alpha`` = log α_t: None (α = 1, DeltaNet), ``[B, T, H]``
(a scalar per head, GDN) or ``[B, T, H, K]`` (one per key channel, KDA); fla calls it ``g``.

* :func:`naive_recurrent_delta_rule` — the recurrence as written, the reference;
* :func:`chunk_delta_rule` — chunkwise-parallel (WY / UT transform), for training;
* :func:`recurrent_delta_rule` / :func:`delta_rule_step` — O(1)-state decoding;
* :func:`fla_delta_rule` — flash-linear-attention's Triton kernels for the same op (CUDA).
"""

from looplm.ops.delta.chunk import chunk_delta_rule, chunk_size_rule
from looplm.ops.delta.fla import fla_delta_rule
from looplm.ops.delta.naive import naive_recurrent_delta_rule
from looplm.ops.delta.recurrent import delta_rule_step, delta_rule_update, recurrent_delta_rule

__all__ = ["chunk_delta_rule", "chunk_size_rule", "delta_rule_step", "fla_delta_rule", "delta_rule_update", "naive_recurrent_delta_rule", "recurrent_delta_rule"]
