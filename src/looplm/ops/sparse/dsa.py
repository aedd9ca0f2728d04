"""DeepSeek Sparse Attention (DeepSeek-AI 2025, "DeepSeek-V3.2"), plain PyTorch reference:
the lightning indexer, its top-k key selection, and the indexer's training loss.

The indexer scores each earlier key s for query t (DeepSeek-V3.2 Eq. (1)),

    I_{t,s} = Σ_j w_{t,j} · ReLU(q^I_{t,j} · k^I_s / √d^I),

with few small heads j and one index key per token shared by all of them (fla's
``naive_dsa_indexer`` with ``activation='relu'``). The main attention of query t then
attends only to the top-k keys by I_{t,·} among s ≤ t (shared by all its heads).

Top-k is not differentiable, so the indexer learns from its own loss (Eq. (2)-(3)):
KL(p_{t,S_t} ‖ softmax(I_{t,S_t})), p being the main attention summed over heads and
L1-normalised, detached. With every key selected (top-k ≥ t + 1) this is the dense warm-up
loss (Eq. (2)); otherwise the sparse-stage loss over the selected set S_t (Eq. (3)).

Cost: the indexer scores are O(T·S·H^I·d^I) time and O(T·S·H^I) memory (as in DeepSeek,
where it is cheap because H^I and d^I are small and it runs in FP8); the selection is
O(T·S). Decoding (T = 1) is O(S).
"""

from __future__ import annotations

from typing import Optional

import torch

from looplm.ops.sparse.common import topk_mask


def index_scores(
    q_index: torch.Tensor, k_index: torch.Tensor, weights: torch.Tensor, scale: Optional[float] = None
) -> torch.Tensor:
    """Lightning-indexer scores I [B, T, S] (Eq. (1)).

    q_index: [B, T, H_I, D_I]; k_index: [B, S, D_I]; weights: [B, T, H_I]; scale defaults
    to D_I^-1/2 (fla's convention).
    """
    scale = q_index.shape[-1] ** -0.5 if scale is None else scale
    dots = torch.matmul(q_index, k_index[:, None].transpose(-1, -2)) * scale  # [B, T, H_I, S]
    return torch.matmul(weights[:, :, None], torch.relu(dots)).squeeze(2)  # Σ_j w_{t,j} ReLU(·): [B, T, S]


def select_keys(scores: torch.Tensor, candidates: torch.Tensor, top_k: int) -> torch.Tensor:
    """Bool [B, T, S]: the ``top_k`` candidate keys (bool [B, T, S]: causal and real) with the
    highest index score per query; ties go to the later key. All candidates when fewer."""
    if top_k >= scores.shape[-1]:
        return candidates.clone()
    return topk_mask(scores.masked_fill(~candidates, float("-inf")), top_k)


def index_kl_loss(
    scores: torch.Tensor, attention: torch.Tensor, selected: torch.Tensor, query_valid: torch.Tensor
) -> torch.Tensor:
    """Mean over real queries of KL(p_t ‖ softmax(I_t)) on the selected keys (Eq. (3)).

    scores: [B, T, S] index scores (carry the indexer's gradient); attention: [B, H, T, S]
    main attention probabilities (zero off the selected keys; detached here); selected:
    bool [B, T, S]; query_valid: bool [B, T].
    """
    target = attention.detach().float().sum(dim=1)  # Σ over heads: [B, T, S]
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(target.dtype).tiny)  # L1-normalise
    has_keys = selected.any(dim=-1, keepdim=True)
    support = selected | ~has_keys  # rows without keys: any finite support, excluded below
    log_q = scores.float().masked_fill(~support, float("-inf")).log_softmax(dim=-1)
    kl = torch.xlogy(target, target) - target * torch.where(selected, log_q, torch.zeros_like(log_q))
    rows = query_valid & has_keys.squeeze(-1)
    return (kl.sum(dim=-1) * rows).sum() / rows.sum().clamp_min(1)
