"""DeepSeek Sparse Attention (DeepSeek-AI 2025, "DeepSeek-V3.2"): the lightning indexer, its
top-k key selection, the attention over the selected keys and the indexer's training loss
(plain PyTorch, with a Triton kernel for the selected-key attention on CUDA).

The indexer scores each earlier key s for query t (DeepSeek-V3.2 Eq. (1)),

    I_{t,s} = Σ_j w_{t,j} · ReLU(q^I_{t,j} · k^I_s / √d^I),

with few small heads j and one index key per token shared by all of them (fla's
``naive_dsa_indexer`` with ``activation='relu'``). The main attention of query t then
attends only to the top-k keys by I_{t,·} among s ≤ t (shared by all its heads).

Top-k is not differentiable, so the indexer learns from its own loss (Eq. (2)-(3)):
KL(p_{t,S_t} ‖ softmax(I_{t,S_t})), p being the main attention summed over heads and
L1-normalised, detached. With every key selected (top-k ≥ t + 1) this is the dense warm-up
loss (Eq. (2)); otherwise the sparse-stage loss over the selected set S_t (Eq. (3)).

Cost: the indexer scores are O(T·S·H^I·d^I) time (as in DeepSeek, where it is cheap
because H^I and d^I are small and it runs in FP8), the selection O(T·S) (one exact top-k,
:func:`~looplm.ops.sparse.common.topk_indices`). :func:`dsa_attention`
works through blocks of queries, scoring each block against the keys up to its last
query, so the live memory is O(block·S·(H + H^I)); in training each block is recomputed in the backward
(activation checkpointing), so what a forward keeps for its backward is O(T·D), not the
T × S scores and probabilities of every head. Decoding (T = 1, :func:`decode_step`) is
O(S·H^I·d^I) in the indexer only; the main attention gathers and reads the k selected
key/value rows (one SDPA call over them).

Queries at positions t < top_k have at most top_k candidates, so they select every one and
DSA is plain causal attention there (:func:`dense_attention`, one SDPA call: flash
attention on CUDA): no index scores, no top-k, no gathers outside training (where the
indexer's dense warm-up loss, Eq. (2), still scores them). At LT2 0.6B's top_k = 2048 a
prefill of up to 2048 tokens is all dense.

Memory of the main attention over the selected keys: the PyTorch reference gathers each
block's selected rows, [B, H_kv, block, k, D] keys and values, and in training takes a
dense masked attention whose [B, H, block, S] probabilities also feed the indexer loss. On
CUDA the Triton kernel (:mod:`~looplm.ops.sparse.selected_triton`) reads the rows in place
and returns the attention mass of just the selected keys for the loss, so per block only
the index scores [B, block, S] and the picks [B, block, k] are allocated besides q, k, v.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from looplm.ops.backend import use_triton
from looplm.ops.grouped_attention import attend_grouped, reads_grouped_heads
from looplm.ops.sparse.common import (
    gathered_attention,
    grouped_attention,
    masked_softmax,
    topk_indices,
    topk_mask,
)

#: queries scored at once against the keys up to the last of them; bounds the live memory at block × S per head
QUERY_BLOCK = 256
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


def select_key_indices(
    scores: torch.Tensor, candidates: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_keys` as positions: (index long [B, T, k], keep bool [B, T, k]), k =
    min(top_k, S); keep is False for the filler entries of a query with fewer candidates.
    The same choice as the mask (one :func:`topk_indices`, ties to the later key)."""
    index, _ = topk_indices(scores.masked_fill(~candidates, float("-inf")), top_k, need_keep=False)
    return index, candidates.gather(-1, index)


def index_kl_loss(
    scores: torch.Tensor, attention: torch.Tensor, selected: torch.Tensor, query_valid: torch.Tensor
) -> torch.Tensor:
    """Mean over real queries of KL(p_t ‖ softmax(I_t)) on the selected keys (Eq. (3)).

    scores: [B, T, S] index scores (carry the indexer's gradient); attention: [B, H, T, S]
    main attention probabilities (zero off the selected keys; detached here); selected:
    bool [B, T, S]; query_valid: bool [B, T].
    """
    total, rows = index_kl_sum(scores, attention.detach().float().sum(dim=1), selected, query_valid)
    return total / rows.clamp_min(1)


def index_kl_sum(
    scores: torch.Tensor, mass: torch.Tensor, selected: torch.Tensor, query_valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over real queries with keys of KL(p_t ‖ softmax(I_t)) on the selected keys, their
    count): the pieces of :func:`index_kl_loss` that add up over blocks of queries.
    mass: [B, T, S] main attention summed over heads (detached)."""
    dtype = torch.promote_types(scores.dtype, torch.float32)  # float32 at least (bf16 scores), float64 kept
    target = mass.detach().to(dtype)
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(target.dtype).tiny)  # L1-normalise
    has_keys = selected.any(dim=-1, keepdim=True)
    support = selected | ~has_keys  # rows without keys: any finite support, excluded below
    log_q = scores.to(dtype).masked_fill(~support, float("-inf")).log_softmax(dim=-1)
    kl = torch.xlogy(target, target) - target * torch.where(selected, log_q, torch.zeros_like(log_q))
    rows = query_valid & has_keys.squeeze(-1)
    return (kl.sum(dim=-1) * rows).sum(), rows.sum()


def dsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: Optional[torch.Tensor],
    k_index: torch.Tensor,
    w_index: Optional[torch.Tensor],
    valid: Optional[torch.Tensor],
    *,
    top_k: int,
    scale: float,
    index_loss: bool = False,
    block: int = QUERY_BLOCK,
    positions: Optional[torch.Tensor] = None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """DSA for the last T of S positions: each query attends to its top-k keys by index score
    among the real keys at or before it (a padding query sees only itself).

    q: [B, H_kv, G, T, D] (query head h·G + g uses KV head h); k, v: [B, H_kv, S, D];
    q_index: [B, T, H^I, d^I]; k_index: [B, S, d^I]; w_index: [B, T, H^I] (q_index and
    w_index may be None when no query is past top_k and there is no loss: nothing reads
    them); valid: bool [B, S] (False: left padding), or None when every position is real. ``index_loss``: also
    return the indexer's KL loss (mean over real queries, Eq. (2)-(3)), else None.
    Returns (o [B, H_kv, G, T, D], loss).

    Two kinds of queries, split at position top_k:

    * a query at position t < top_k has at most t + 1 <= top_k candidates, so its top-k is
      every candidate and DSA is exactly causal attention over them: all such queries run as
      one :func:`dense_attention` (SDPA: flash attention on CUDA), without index scores or a
      top-k unless the indexer loss needs them (then blocks of ``block`` queries score their
      keys for the dense warm-up loss, Eq. (2), the attention target recomputed without grad);
    * the later queries go block by block: score the keys up to the block's last query,
      select, attend (:func:`decode_step` for one decoding query). ``kernel``
      (:data:`~looplm.ops.backend.KERNELS`): where the selected-key attention of these blocks runs; the Triton
      kernel reads the selected rows in place (no [B, H_kv, T, k, D] gathers, no dense
      [B, H, T, S] probabilities for the indexer loss, see
      :mod:`~looplm.ops.sparse.selected_triton`).

    With grad enabled and more than ``block`` queries, each block is checkpointed.
    ``positions`` is passed on to :func:`decode_step`.
    """
    T, S = q.shape[3], k.shape[2]
    first = S - T  # the position of the first query
    dense = min(T, max(top_k - first, 0))  # queries at positions < top_k: every candidate selected
    if T == 1 and not index_loss and not dense:  # a decoding step past top_k
        return decode_step(q, k, v, q_index, k_index, w_index, valid, top_k=top_k, scale=scale, positions=positions), None
    outputs = []
    if dense:
        end = first + dense
        outputs.append(dense_attention(q[:, :, :, :dense], k[:, :, :end], v[:, :, :end],
                                       None if valid is None else valid[:, :end], scale))
    keep = torch.is_grad_enabled() and T > block
    fast = use_triton(q, kernel)
    total, rows = 0.0, 0
    starts = [*range(0, dense, block)] if index_loss else []
    for start in starts + [*range(dense, T, block)]:
        end = min(start + block, dense if start < dense else T)  # a block is all dense or all sparse
        args = (q[:, :, :, start:end], k, v, q_index[:, start:end], k_index, w_index[:, start:end], valid,
                first + start, top_k, scale, index_loss, fast)
        run = _dense_loss_block if start < dense else _dsa_block
        o, block_total, block_rows = checkpoint(run, *args, use_reentrant=False) if keep else run(*args)
        if o is not None:
            outputs.append(o)
        if index_loss:
            total, rows = total + block_total, rows + block_rows
    if not outputs:  # no queries
        outputs.append(q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=v.dtype))
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=3)
    return o, (total / torch.as_tensor(rows, device=q.device).clamp_min(1) if index_loss else None)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: Optional[torch.Tensor], scale: float
) -> torch.Tensor:
    """DSA where every candidate is selected (each query has at most top_k): softmax
    attention of the last Q of S positions over the real keys at or before each, a padding
    query over itself only, through SDPA (flash attention on CUDA without padding; no [Q, S]
    probabilities kept for the backward), the grouped key/value heads read in place
    wherever the kernel takes them (:mod:`looplm.ops.grouped_attention`).

    q: [B, H_kv, G, Q, D]; k, v: [B, H_kv, S, D]; valid: bool [B, S] or None (all real).
    Returns o [B, H_kv, G, Q, D_v] in v's dtype."""
    B, Hkv, G, Q, D = q.shape
    S = k.shape[2]
    mask = None
    if valid is not None:
        mask = _candidates(valid, S - Q, Q)[0][:, None]  # [B, 1, Q, S]
    elif 1 < Q < S:  # later queries of a chunk: causal, aligned to the last key
        mask = torch.ones(Q, S, dtype=torch.bool, device=q.device).tril(S - Q)
    q = q.reshape(B, Hkv * G, Q, D)
    if G > 1 and Q > 1 and not reads_grouped_heads(q, mask):  # no kernel here reads grouped heads: copies
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    o = attend_grouped(q, k, v, mask, is_causal=mask is None and Q > 1, scale=scale)
    return o.view(B, Hkv, G, Q, v.shape[-1])


def decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor,
    w_index: torch.Tensor, valid: Optional[torch.Tensor], *, top_k: int, scale: float,
    positions: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One decoding step of DSA (one query, the last of S positions, top_k < S): score the
    index keys, take one exact :func:`topk_indices` over the row and attend to the k gathered
    rows only (one SDPA call), O(S·H^I·d^I + k·H·D). Shapes as :func:`dsa_attention` with
    T = 1. valid: None when every key is real (then no candidate mask and no -inf flags),
    else bool [B, S]: the real keys are the candidates (a padding query's only candidate is
    itself). ``positions``: an int32 arange of at least S entries kept by the caller (built
    here when None). ``bias``: [B, S], 0 on the keys the query may pick and -inf elsewhere,
    given whole (a static cache's rows, where the query is not the last row; the static
    cache's attention bias, made once per forward); then ``valid`` is unused, the scores
    are masked by adding it (x + 0 is x: the same ranking as a masked fill) and the picks'
    own entries of it give fillers, when fewer than top_k rows are candidates, no weight.
    Returns o [B, H_kv, G, 1, D].
    """
    B, Hkv, G, _, D = q.shape
    S = k.shape[2]
    scores = index_scores(q_index, k_index, w_index)[:, 0]  # Eq. (1): [B, S]
    if bias is not None:
        scores = scores + bias
    elif valid is not None:
        candidates = valid & valid[:, S - 1:]  # a padding query: nothing ...
        candidates[:, S - 1] = True  # ... but itself (a real query's own key is real)
        scores = scores.masked_fill(~candidates, float("-inf"))
    index, keep = topk_indices(scores, top_k, positions, need_keep=valid is not None and bias is None)  # [B, k]
    rows = index[:, None, :, None]  # [B, 1, k, 1], broadcast over heads and channels
    k_sel = k.gather(2, rows.expand(B, Hkv, -1, D))  # [B, H_kv, k, D]
    v_sel = v.gather(2, rows.expand(B, Hkv, -1, v.shape[-1]))
    # fewer candidates than k: the fillers get no weight (a row always has itself)
    mask = bias.gather(1, index) if bias is not None else keep
    # one fused attention over the k picks, each group's G query heads folded into the query
    # axis (attend_grouped): an MHA-shaped call that every kernel takes, masked or not
    o = attend_grouped(q.reshape(B, Hkv * G, 1, D), k_sel, v_sel, None if mask is None else mask[:, None, None],
                       scale=scale)
    return o.view(B, Hkv, G, 1, v.shape[-1])


def _candidates(valid: Optional[torch.Tensor], first: int, Q: int, batch: int = 1,
                device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidates bool [B, Q, S], query_valid bool [B, Q]) of the Q queries at positions
    first .. first + Q − 1 = S − 1: causal and real keys; a padding query has only itself.
    ``valid``: bool [B, >= S] (read up to S), or None: every position real (``batch``,
    ``device`` then shape the result)."""
    S = first + Q
    device = valid.device if valid is not None else device
    key = torch.arange(S, device=device)
    query = torch.arange(first, S, device=device)[:, None]  # [Q, 1]
    causal = (key <= query)[None]  # [1, Q, S]
    if valid is None:
        return causal.expand(batch, Q, S), torch.ones(batch, Q, dtype=torch.bool, device=device)
    query_valid = valid[:, first:S]
    return torch.where(query_valid[..., None], causal & valid[:, None, :S], (key == query)[None]), query_valid


def _dsa_block(q, k, v, q_index, k_index, w_index, valid, first: int, top_k: int, scale: float, index_loss: bool,
               fast: bool):
    """One block of Q queries at absolute positions first .. first + Q − 1 against the keys at
    or before its last query (the later ones are never candidates)."""
    S = first + q.shape[3]
    k, v, k_index = k[:, :, :S], v[:, :, :S], k_index[:, :S]
    scores = index_scores(q_index, k_index, w_index)  # Eq. (1): [B, Q, S]
    candidates, query_valid = _candidates(valid, first, q.shape[3], q.shape[0], q.device)
    return _selected_block(q, k, v, scores, candidates, query_valid, top_k, scale, index_loss, fast)


def _dense_loss_block(q, k, v, q_index, k_index, w_index, valid, first: int, top_k: int, scale: float,
                      index_loss: bool, fast: bool):
    """The indexer loss pieces of a block of queries that select every candidate (the dense
    warm-up loss, Eq. (2)); their output comes from :func:`dense_attention`, so the
    attention target is recomputed here without grad (it is detached in the loss anyway).
    Returns (None, total, rows)."""
    S = first + q.shape[3]
    scores = index_scores(q_index, k_index[:, :S], w_index)  # Eq. (1): [B, Q, S]
    candidates, query_valid = _candidates(valid, first, q.shape[3], q.shape[0], q.device)
    with torch.no_grad():
        dots = torch.matmul(q, k[:, :, None, :S].transpose(-1, -2)) * scale  # [B, H_kv, G, Q, S]
        mass = masked_softmax(dots, candidates[:, None, None]).sum(dim=(1, 2))  # summed over heads: [B, Q, S]
    total, rows = index_kl_sum(scores, mass, candidates & query_valid[..., None], query_valid)
    return None, total, rows


def _selected_block(q, k, v, scores, candidates, query_valid, top_k: int, scale: float, index_loss: bool, fast: bool):
    """A block's attention over its top-k candidates (bool [B, Q, S]) by index score, and its
    indexer-loss pieces when ``index_loss``."""
    S = k.shape[2]
    if fast and top_k < S:  # the kernel reads the selected rows in place; the loss sees only them
        from looplm.ops.sparse.selected_triton import selected_attention

        index, keep = select_key_indices(scores, candidates, top_k)
        o, mass = selected_attention(q, k, v, index, keep, scale, with_mass=index_loss)
        if not index_loss:
            return o, None, None
        selected = keep & query_valid[..., None]  # a padding query's own key is not a selection
        total, rows = index_kl_sum(scores.gather(-1, index), mass.sum(dim=1), selected, query_valid)  # [B, Q, k]
        return o, total, rows
    if not index_loss and top_k < S:  # read only the selected keys and values (decoding, evaluation)
        index, keep = select_key_indices(scores, candidates, top_k)
        o = gathered_attention(q, k, v, index, keep, scale)
        return o, None, None
    allowed = select_keys(scores, candidates, top_k)
    o, p = grouped_attention(q, k, v, allowed[:, None, None], scale)  # p: [B, H_kv, G, Q, S] float32
    if not index_loss:
        return o, None, None
    selected = allowed & query_valid[..., None]  # a padding query's own key is not a selection
    total, rows = index_kl_sum(scores, p.detach().sum(dim=(1, 2)), selected, query_valid)
    return o, total, rows
