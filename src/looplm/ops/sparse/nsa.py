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

Cost (T queries, S keys, N = S/d compressed blocks, n·l' selected keys, window w, per
head): the compressed branch and the block selection are dense over the N compressed
blocks, O(T·N·D) time and O(T·N) memory (N = S/16 at the defaults: still quadratic in T,
16× smaller than attention). The selected branch gathers each query's n·l' keys and values,
O(T·n·l'·D) time and memory; the window branch scores blocks of queries against the key
span they reach, O(T·(128 + w)·D). Both branches gather only the rows they read (no
padded or compacted copy of the cache). :func:`naive_nsa_attention` is the dense reference
the fast form is tested against (every query against every key, O(T·S) memory). Decoding
(T = 1) is O((N + n·l' + w)·D).
"""

from __future__ import annotations

from typing import Union

import torch

from looplm.ops.sparse.common import gathered_attention, grouped_attention, masked_softmax, topk_mask


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
    Equal to :func:`naive_nsa_attention` to rounding, without its T × S tensors.
    """
    o_cmp, selected = _compressed_and_selection(q, k_cmp, v_cmp, positions, k.shape[2], block_size=block_size,
                                                stride=stride, select_size=select_size, n_select=n_select,
                                                scale=scale)

    o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * _selected_branch(q, k, v, selected, positions, select_size, scale)
    if window > 0:
        o = o + gates[..., 2:3] * _window_branch(q, k, v, positions, window, scale)
    return o, selected


def nsa_static_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    column_of: torch.Tensor,
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
) -> torch.Tensor:
    """:func:`nsa_attention` over a static cache, with shapes that never depend on the data
    (no host read: a captured decoding step). The keys stay in their columns: k, v [B, H_kv,
    C, D]; ``column_of`` [B, ≥ C] long maps row b's position c to its column; k_cmp, v_cmp
    [B, H_kv, N, D] hold the compressed blocks of every row's own positions (those not yet
    complete are never read). Each query gathers only what it reads: the ``n_select`` selected
    blocks (a fixed width; unpicked slots masked) and its last ``window`` positions. Equal to
    :func:`nsa_attention` on the compacted keys to rounding. Returns o [B, H_kv, G, T, D]."""
    B, Hkv, G, T, D = q.shape
    C = k.shape[2]
    o_cmp, selected = _compressed_and_selection(q, k_cmp, v_cmp, positions, C, block_size=block_size, stride=stride,
                                                select_size=select_size, n_select=n_select, scale=scale)
    key, keep = _selected_keys(selected, positions, select_size, min(n_select, selected.shape[-1]))
    width = key.shape[-1]
    columns = column_of.gather(1, key.clamp(max=C).view(B, Hkv * T * width)).view(B, Hkv, T, width)
    # a selection differs per KV head: each (row, head) pair gathers from its own keys
    o_slc = gathered_attention(
        q.reshape(B * Hkv, 1, G, T, D), k.reshape(B * Hkv, 1, C, D), v.reshape(B * Hkv, 1, C, v.shape[-1]),
        columns.clamp(max=C - 1).reshape(B * Hkv, T, width), keep.reshape(B * Hkv, T, width), scale,
    ).view(B, Hkv, G, T, v.shape[-1])
    o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc
    if window > 0:
        recent = positions[..., None] - (window - 1) + torch.arange(window, device=q.device)  # [B, T, w]
        near = (recent >= 0) & (positions[..., None] >= 0)
        rows = column_of.gather(1, recent.clamp(min=0).view(B, T * window)).view(B, T, window).clamp(max=C - 1)
        o = o + gates[..., 2:3] * gathered_attention(q, k, v, rows, near, scale)
    return o


def _compressed_and_selection(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, positions: torch.Tensor, n_keys: int, *,
    block_size: int, stride: int, select_size: int, n_select: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed branch (block j visible once j·d + l − 1 ≤ t) and, from its attention
    mass summed over a KV group, the selected l'-blocks (Eq. (9)-(11)).
    Returns (o_cmp [B, H_kv, G, T, D], selected bool [B, H_kv, T, ⌈n_keys / l'⌉])."""
    N, device = k_cmp.shape[2], q.device
    last = torch.arange(N, device=device) * stride + block_size - 1
    o_cmp, p_cmp = grouped_attention(q, k_cmp, v_cmp, last <= positions[:, None, None, :, None], scale)
    overlap = selection_overlap(N, -(-n_keys // select_size), block_size, stride, select_size, device)
    importance = p_cmp.detach().sum(dim=2) @ overlap.to(p_cmp.dtype)  # Eq. (9)-(10): [B, H_kv, T, N_sel]
    return o_cmp, select_blocks(importance, positions, select_size, n_select)


def _selected_keys(selected: torch.Tensor, positions: torch.Tensor, select_size: int, n: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The key positions of ``n`` selected l'-blocks per query and which of them it reads:
    (key long [B, H_kv, T, n·l'], keep bool, the same shape). A query with fewer than n
    blocks picked gets filler blocks (keep False), and the keys after t are never kept.
    selected [B, H_kv, T, N_sel]; positions [B, T] of the queries (−1: padding)."""
    B, Hkv, T, _ = selected.shape
    L = select_size
    picked, index = torch.topk(selected.to(torch.uint8), n, dim=-1)  # [B, H_kv, T, n]; picked 0: a filler
    key = (index[..., None] * L + torch.arange(L, device=selected.device)).view(B, Hkv, T, n * L)
    keep = picked.bool()[..., None].expand(-1, -1, -1, -1, L).reshape(B, Hkv, T, n * L) & (
        key <= positions[:, None, :, None])
    return key, keep


def _selected_branch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor, positions: torch.Tensor,
    select_size: int, scale: float,
) -> torch.Tensor:
    """Attention of each query over the keys ≤ t of its selected blocks, gathered: O(T·n·l')
    scores and O(T·n·l'·D) gathered keys and values instead of T × S scores.
    q [B, H_kv, G, T, D]; k, v [B, H_kv, S, D]; selected [B, H_kv, T, N_sel] -> [B, H_kv, G, T, D]."""
    B, Hkv, G, T, D = q.shape
    S, n_sel, L = k.shape[2], selected.shape[-1], select_size
    n = min(int(selected.sum(-1).max()) if selected.numel() else 0, n_sel)  # most blocks any query takes
    if n == 0 or S == 0:
        return torch.zeros_like(q)
    key, keep = _selected_keys(selected, positions, L, n)
    rows = key.clamp(max=S - 1).reshape(B, Hkv, T * n * L, 1)  # the last block's tail: masked below

    def gather(x: torch.Tensor) -> torch.Tensor:  # [B, H_kv, S, D] -> [B, H_kv, T, n·l', D], only those rows
        return x.gather(2, rows.expand(-1, -1, -1, x.shape[-1])).view(B, Hkv, T, n * L, x.shape[-1])

    allowed = keep[:, :, :, None]  # [B, H_kv, T, 1, n·l']
    qt = q.permute(0, 1, 3, 2, 4)  # [B, H_kv, T, G, D]
    scores = torch.matmul(qt, gather(k).transpose(-1, -2)) * scale  # [B, H_kv, T, G, n·l']
    o = torch.matmul(masked_softmax(scores, allowed).to(v.dtype), gather(v))  # [B, H_kv, T, G, D]
    return o.permute(0, 1, 3, 2, 4)


def _window_branch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, window: int, scale: float,
    block: int = 128,
) -> torch.Tensor:
    """Attention of each query over its last ``window`` keys, by blocks of Q queries: each
    block scores one span of L keys, the longest span any block's positions reach
    (Q + w − 1 when positions are consecutive), so O(T·(Q + w)) instead of T × S. The
    spans are gathered in one op (slicing per block would make autograd fill a full-size
    gradient per block). q [B, H_kv, G, T, D]; k, v [B, H_kv, S, D]; positions [B, T]
    -> [B, H_kv, G, T, D]."""
    B, Hkv, G, T, D = q.shape
    S = k.shape[2]
    if T == 0 or S == 0:
        return torch.zeros_like(q)
    Q = max(block, window)
    n_blocks = -(-T // Q)
    pad = n_blocks * Q - T
    pos = torch.nn.functional.pad(positions, (0, pad), value=-1).view(B, n_blocks, Q)
    hi = pos.amax(dim=(0, 2)) + 1  # [n_blocks] one past the last key a query of the block reads
    first = torch.where(pos >= 0, pos, pos.new_full((), S)).amin(dim=(0, 2))
    lo = torch.minimum((first - window + 1).clamp(min=0), hi.clamp(min=0))  # [n_blocks]
    L = max(int((hi - lo).max()), 1)
    key = lo[:, None] + torch.arange(L, device=q.device)  # [n_blocks, L] key positions (≥ S: past the end)
    rows = key.clamp(max=S - 1).reshape(-1)  # positions past the end read the last key, masked below

    def spans(x: torch.Tensor) -> torch.Tensor:  # [B, H_kv, S, D] -> [B, H_kv, 1, n_blocks, L, D]
        return x.index_select(2, rows).view(B, Hkv, 1, n_blocks, L, D)  # only those rows: no padded copy of x

    qb = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(B, Hkv, G, n_blocks, Q, D)
    p = pos[:, None, None, :, :, None]  # [B, 1, 1, n_blocks, Q, 1]
    allowed = (key[:, None, :] <= p) & (key[:, None, :] > p - window)  # [B, 1, 1, n_blocks, Q, L]
    scores = torch.matmul(qb, spans(k).transpose(-1, -2)) * scale  # [B, H_kv, G, n_blocks, Q, L]
    o = torch.matmul(masked_softmax(scores, allowed).to(v.dtype), spans(v))
    return o.view(B, Hkv, G, n_blocks * Q, D)[:, :, :, :T]


def naive_nsa_attention(
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
    """Dense reference of :func:`nsa_attention` (same arguments and results): every query
    scored against every key, the selected and window branches cut out by masks (the
    compressed branch and the selection are shared). O(T·S) time and memory.

    q: [B, H_kv, G, T, D] (query head h·G + g uses KV head h, as fla's GQA); k, v:
    [B, H_kv, S, D], key c at position c; k_cmp, v_cmp: [B, H_kv, N, D], compressed block
    j (entries of blocks not yet complete for a row are never read); gates: [B, H_kv, G, T, 3]
    (σ already applied: compressed, selected, window); positions: [B, T] of the queries,
    −1 for padding. window 0 drops the window branch (fla's convention).

    Returns (o [B, H_kv, G, T, D], selected blocks bool [B, H_kv, T, ⌈S / l'⌉]).
    """
    S = k.shape[2]
    device = q.device
    pos = positions[:, None, None, :, None]  # [B, 1, 1, T, 1]
    o_cmp, selected = _compressed_and_selection(q, k_cmp, v_cmp, positions, S, block_size=block_size, stride=stride,
                                                select_size=select_size, n_select=n_select, scale=scale)

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
