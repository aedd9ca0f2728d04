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
key/value rows (37 dispatched operators per layer and token).

Memory of the main attention over the selected keys: the PyTorch reference gathers each
block's selected rows, [B, H_kv, block, k, D] keys and values, and in training takes a
dense masked attention whose [B, H, block, S] probabilities also feed the indexer loss. On
CUDA the Triton kernel (:mod:`~looplm.ops.sparse.selected_triton`) reads the rows in place
and returns the attention mass of just the selected keys for the loss, so per block only
the index scores [B, block, S] and the picks [B, block, k] are allocated besides q, k, v.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from looplm.ops.sparse.common import gathered_attention, grouped_attention, topk_indices, topk_mask

#: queries scored at once against the keys up to the last of them; bounds the live memory at block × S per head
QUERY_BLOCK = 256
#: how the main attention over the selected keys runs: "auto" (the Triton kernel on CUDA when
#: triton is installed, the PyTorch reference elsewhere), "torch" (always the reference),
#: "triton" (always the kernel; CPU tensors need TRITON_INTERPRET=1)
KERNELS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_selected_kernel(x: torch.Tensor, kernel: str) -> bool:
    """Whether the selected-key attention runs :mod:`~looplm.ops.sparse.selected_triton`."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
    return kernel == "triton" or (kernel == "auto" and x.is_cuda and triton_installed())


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
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    w_index: torch.Tensor,
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
    among the real keys at or before it (a padding query sees only itself), block by block.

    q: [B, H_kv, G, T, D] (query head h·G + g uses KV head h); k, v: [B, H_kv, S, D];
    q_index: [B, T, H^I, d^I]; k_index: [B, S, d^I]; w_index: [B, T, H^I]; valid: bool
    [B, S] (False: left padding), or None when every position is real. A decoding step (T =
    1, no loss) is :func:`decode_step`; ``positions`` is passed on to it. ``index_loss``:
    also return the indexer's KL loss (mean over real queries, Eq. (2)-(3)), else None.
    Returns (o [B, H_kv, G, T, D], loss).
    With grad enabled and more than one block, each block is checkpointed. ``kernel``
    (:data:`KERNELS`): where the selected-key attention of a prefill or training block runs;
    the Triton kernel reads the selected rows in place (no [B, H_kv, T, k, D] gathers, no
    dense [B, H, T, S] probabilities for the indexer loss, see
    :mod:`~looplm.ops.sparse.selected_triton`).
    """
    T, S = q.shape[3], k.shape[2]
    if T == 1 and not index_loss and top_k < S:  # a decoding step
        return decode_step(q, k, v, q_index, k_index, w_index, valid, top_k=top_k, scale=scale, positions=positions), None
    keep = torch.is_grad_enabled() and T > block
    fast = use_selected_kernel(q, kernel)
    outputs, total, rows = [], 0.0, 0
    for start in range(0, max(T, 1), block):  # one (empty) block when T = 0
        end = min(start + block, T)
        args = (q[:, :, :, start:end], k, v, q_index[:, start:end], k_index, w_index[:, start:end], valid,
                S - T + start, top_k, scale, index_loss, fast)
        o, block_total, block_rows = checkpoint(_dsa_block, *args, use_reentrant=False) if keep else _dsa_block(*args)
        outputs.append(o)
        if index_loss:
            total, rows = total + block_total, rows + block_rows
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=3)
    return o, (total / rows.clamp_min(1) if index_loss else None)


def decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor,
    w_index: torch.Tensor, valid: Optional[torch.Tensor], *, top_k: int, scale: float,
    positions: Optional[torch.Tensor] = None, candidates: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One decoding step of DSA (one query, the last of S positions, top_k < S): score the
    index keys, take one exact :func:`topk_indices` over the row and attend to the k gathered
    rows only, O(S·H^I·d^I + k·H·D). Shapes as :func:`dsa_attention` with T = 1. valid: None
    when every key is real (then no candidate mask and no -inf flags), else bool [B, S]: the
    real keys are the candidates (a padding query's only candidate is itself). ``positions``:
    an int32 arange of at least S entries kept by the caller (built here when None).
    ``candidates``: bool [B, S], the keys the query may pick, given whole (a static cache's
    rows, where the query is not the last row); then ``valid`` is unused and fillers, when
    fewer than top_k rows are candidates, get no weight.
    Returns o [B, H_kv, G, 1, D].
    """
    B, Hkv, G, _, D = q.shape
    S = k.shape[2]
    scores = index_scores(q_index, k_index, w_index)[:, 0]  # Eq. (1): [B, S]
    if candidates is not None:
        scores, valid = scores.masked_fill(~candidates, float("-inf")), candidates
    elif valid is not None:
        candidates = valid & valid[:, S - 1:]  # a padding query: nothing ...
        candidates[:, S - 1] = True  # ... but itself (a real query's own key is real)
        scores = scores.masked_fill(~candidates, float("-inf"))
    index, keep = topk_indices(scores, top_k, positions, need_keep=valid is not None)  # [B, k]
    rows = index[:, None, :, None]  # [B, 1, k, 1], broadcast over heads and channels
    k_sel = k.gather(2, rows.expand(B, Hkv, -1, D))  # [B, H_kv, k, D]
    v_sel = v.gather(2, rows.expand(B, Hkv, -1, v.shape[-1]))
    s = torch.matmul(q[:, :, :, 0], k_sel.transpose(-1, -2)) * scale  # [B, H_kv, G, k]
    if keep is not None:  # fewer candidates than k: the fillers get no weight (a row always has itself)
        s = s.masked_fill(~keep[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=s.dtype if s.dtype == torch.float64 else torch.float32)  # float32 at least
    return torch.matmul(p.to(v.dtype), v_sel)[:, :, :, None]  # [B, H_kv, G, 1, D]


def _dsa_block(q, k, v, q_index, k_index, w_index, valid, first: int, top_k: int, scale: float, index_loss: bool,
               fast: bool):
    """One block of Q queries at absolute positions first .. first + Q − 1 against the keys at
    or before its last query (the later ones are never candidates)."""
    Q = q.shape[3]
    S = first + Q
    k, v, k_index = k[:, :, :S], v[:, :, :S], k_index[:, :S]
    scores = index_scores(q_index, k_index, w_index)  # Eq. (1): [B, Q, S]
    key = torch.arange(S, device=q.device)
    query = torch.arange(first, first + Q, device=q.device)[:, None]  # [Q, 1]
    causal = (key <= query)[None]  # [1, Q, S]
    if valid is None:
        query_valid = torch.ones(q.shape[0], Q, dtype=torch.bool, device=q.device)
        candidates = causal.expand(q.shape[0], Q, S)
    else:
        query_valid = valid[:, first:S]
        candidates = torch.where(  # [B, Q, S]: causal and real; a padding query sees only itself
            query_valid[..., None], causal & valid[:, None, :S], (key == query)[None]
        )
    return _selected_block(q, k, v, scores, candidates, query_valid, top_k, scale, index_loss, fast)


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
