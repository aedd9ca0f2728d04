"""Native Sparse Attention (Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned and
Natively Trainable Sparse Attention"), plain PyTorch reference.

Each query t attends through three branches, mixed by per-head gates (NSA Eq. (5)):

    o_t = g_cmp · Attn(q_t, K̃_cmp, Ṽ_cmp) + g_slc · Attn(q_t, K_slc, V_slc) + g_swa · Attn(q_t, K_win, V_win)

* compressed: block j covers positions [j·d, j·d + l) and is summarised into one key and
  value (Eq. (7)); query t sees block j only once the whole block is at or before t,
  j·d + l − 1 ≤ t (strict causality; fla's ``naive_nsa_compression``).
* selected: the positions are cut into blocks of l'; block i's importance is the
  compressed attention mass (summed over the query heads of a KV group, Eq. (10)) on the
  compressed blocks that overlap it (Eq. (9); for l = d = l' simply p_cmp[i], fla's case).
  The first block and the two local blocks (the query's own, partly filled, and the one
  before) are always taken (§3.3.2, fla's ``naive_nsa_topk``); the rest of the n slots go to
  the most important blocks that start at or before t. Attention over their keys ≤ t.
* sliding window: the last w positions, t itself included (fla: ``window_size=(w-1, 0)``).

Positions here are *compacted*: key index c has position c, so a left-padded row is
handled by moving its real keys to the front before calling (``positions`` = −1 marks a
padding query, whose output is 0).

Cost: this reference scores every query against every key once (shared by the selected
and window branches) and every compressed block: O(T·S·D) time and O(T·S) memory per head,
like dense attention; the masks make it exact, not fast. Decoding (T = 1) is O(S·D).
"""

from __future__ import annotations

from typing import Union

import torch

from looplm.ops.sparse.common import grouped_attention, masked_softmax, topk_mask


def compressed_block_count(n: Union[int, torch.Tensor], block_size: int, stride: int) -> Union[int, torch.Tensor]:
    """Number of complete compression blocks [j·d, j·d + l) among n positions."""
    if isinstance(n, torch.Tensor):
        return torch.clamp((n - block_size).div(stride, rounding_mode="floor") + 1, min=0)
    return max((n - block_size) // stride + 1, 0)


def selection_overlap(
    n_cmp: int, n_sel: int, block_size: int, stride: int, select_size: int, device=None
) -> torch.Tensor:
    """[n_cmp, n_sel] float: 1 where compressed block j ([j·d, j·d + l)) overlaps selection
    block i ([i·l', (i+1)·l')). NSA Eq. (9) sums p_cmp over the compressed blocks of a
    selection block; this is that sum written by overlap (the identity when l = d = l')."""
    j = torch.arange(n_cmp, device=device)[:, None] * stride
    i = torch.arange(n_sel, device=device)[None, :] * select_size
    return ((j < i + select_size) & (j + block_size > i)).float()


def select_blocks(importance: torch.Tensor, positions: torch.Tensor, select_size: int, n_select: int) -> torch.Tensor:
    """NSA's top-n block selection (Eq. (11)) with the initial and two local blocks forced.

    importance: [B, H_kv, T, N_sel] (p_slc'); positions: [B, T] (−1: padding query).
    Returns bool [B, H_kv, T, N_sel]: the blocks query t attends to. Only blocks that
    start at or before t can be chosen; ties go to the later block.
    """
    n_sel = importance.shape[-1]
    block = torch.arange(n_sel, device=importance.device)  # [N_sel]
    pos = positions[:, None, :, None]  # [B, 1, T, 1]
    own = pos.div(select_size, rounding_mode="floor")
    visible = (block * select_size <= pos) & (pos >= 0)  # the block has a key at or before t
    forced = visible & ((block == 0) | (block == own) | (block == own - 1))  # §3.3.2: 1 initial + 2 local
    score = importance.float().masked_fill(~visible, float("-inf")).masked_fill(forced, float("inf"))
    return topk_mask(score, n_select)


def nsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    gates: torch.Tensor,
    positions: torch.Tensor,
    *,
    block_size: int,
    stride: int,
    select_size: int,
    n_select: int,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The three gated NSA branches for T queries over S compacted keys.

    q: [B, H_kv, G, T, D] (query head h·G + g uses KV head h, as fla's GQA); k, v:
    [B, H_kv, S, D], key c at position c; k_cmp, v_cmp: [B, H_kv, N, D], compressed block
    j (entries of blocks not yet complete for a row are never read); gates: [B, H_kv, G, T, 3]
    (σ already applied: compressed, selected, window); positions: [B, T] of the queries,
    −1 for padding. window 0 drops the window branch (fla's convention).

    Returns (o [B, H_kv, G, T, D], selected blocks bool [B, H_kv, T, ⌈S / l'⌉]).
    """
    S, N = k.shape[2], k_cmp.shape[2]
    device = q.device
    pos = positions[:, None, None, :, None]  # [B, 1, 1, T, 1]

    # compressed branch: block j visible once j·d + l − 1 ≤ t
    last = torch.arange(N, device=device) * stride + block_size - 1
    o_cmp, p_cmp = grouped_attention(q, k_cmp, v_cmp, last <= pos, scale)

    # selection: importance of each l'-block from the compressed scores, shared in a KV group
    n_sel = -(-S // select_size)
    overlap = selection_overlap(N, n_sel, block_size, stride, select_size, device)
    importance = p_cmp.detach().sum(dim=2) @ overlap  # Eq. (9)-(10): [B, H_kv, T, N_sel]
    selected = select_blocks(importance, positions, select_size, n_select)

    key = torch.arange(S, device=device)
    causal = key <= pos  # [B, 1, 1, T, S]
    key_selected = selected.index_select(-1, key.div(select_size, rounding_mode="floor"))[:, :, None]
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, H_kv, G, T, S], both branches
    values = v.unsqueeze(2)
    o_slc = torch.matmul(masked_softmax(scores, key_selected & causal).to(v.dtype), values)
    o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc
    if window > 0:
        o_swa = torch.matmul(masked_softmax(scores, causal & (key > pos - window)).to(v.dtype), values)
        o = o + gates[..., 2:3] * o_swa
    return o, selected
