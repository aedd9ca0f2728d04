"""Pieces shared by the sparse-attention ops: a softmax that tolerates rows with nothing to
attend to, masked attention over grouped query heads, and a top-k with deterministic ties.

Exactness matters more than speed here: prefill + decoding must pick the same keys as one
full forward, so ties in a top-k are broken by position (the later key wins), never by the
order a kernel happens to visit them (:func:`topk_indices`).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(scores) over the last dim restricted to ``allowed`` (broadcastable bool);
    a row with no allowed entry gives all zeros (no NaN, forward or backward). Computed and
    returned in float32, or float64 for float64 scores."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).masked_fill(~allowed, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True).detach()
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # empty rows: exp(-inf) = 0
    e = torch.exp(scores - peak)
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of grouped query heads over shared keys, with an explicit mask.

    q: [B, H_kv, G, T, D]; k, v: [B, H_kv, S, D]; allowed: bool, broadcastable to
    [B, H_kv, G, T, S]. Returns (o [B, H_kv, G, T, D] in v's dtype, p [B, H_kv, G, T, S]
    in at least float32). Rows with nothing allowed give o = 0. Cost O(T·S) per head: a dense
    reference for a mask that is sparse.
    """
    if k.shape[2] == 0:  # nothing to attend to yet (e.g. no complete compressed block)
        o = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=v.dtype, device=q.device)
        return o, torch.zeros(*q.shape[:-1], 0, device=q.device)
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, H_kv, G, T, S]
    p = masked_softmax(scores, allowed)
    return torch.matmul(p.to(v.dtype), v.unsqueeze(2)), p


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index[b]`` of every head of batch row b: x [B, H, S, D], index long [B, n]
    -> [B, H, n, D], reading only those rows. When x's rows are contiguous (a cache buffer's
    view), one ``index_select`` over all B·H·n rows of its storage; otherwise one per batch
    row (on CPU both are several times faster than ``gather`` with an expanded index,
    which indexes every element)."""
    B, H, S, D = x.shape
    s0, s1, s2, s3 = x.stride()
    if B == 1:
        return x.index_select(2, index[0])
    if s3 == 1 and s2 == D and s0 % D == 0 and s1 % D == 0 and not (torch.is_grad_enabled() and x.requires_grad):
        rows = (torch.arange(B, device=x.device)[:, None, None] * (s0 // D)
                + torch.arange(H, device=x.device)[None, :, None] * (s1 // D) + index[:, None, :])
        span = ((B - 1) * s0 + (H - 1) * s1 + (S - 1) * s2) // D + 1  # rows from x's first to its last
        return x.as_strided((span, D), (D, 1)).index_select(0, rows.reshape(-1)).view(B, H, index.shape[1], D)
    return torch.cat([x[b:b + 1].index_select(2, index[b]) for b in range(B)])


def gathered_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, keep: Optional[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """:func:`grouped_attention`'s output when query t may read only the keys ``index[b, t]``
    (those with ``keep`` True), reading only those rows: the keys and values are gathered
    per query, so the cost is O(T·width) per head instead of O(T·S) (a decoding step of DSA
    touches its top-k keys, never a score row over the whole cache).

    q: [B, H_kv, G, T, D]; k, v: [B, H_kv, S, D]; index: long [B, T, width], distinct key
    positions per row (e.g. from :func:`topk_indices`); keep: bool [B, T, width] (False:
    a filler entry, ignored; a row's kept entries come first, as :func:`topk_indices` orders
    them), or None when every entry is kept. Returns o [B, H_kv, G, T, D] in v's dtype; a
    row with nothing kept gives zeros.
    """
    B, Hkv, G, T, D = q.shape
    width = index.shape[-1]
    if keep is not None:  # fillers read the row's first pick (kept if any is) and get weight 0
        index = torch.where(keep, index, index[..., :1])
    flat = index.reshape(B, T * width)
    k_sel = gather_rows(k, flat).view(B, Hkv, T, width, D)
    v_sel = gather_rows(v, flat).view(B, Hkv, T, width, v.shape[-1])
    scores = torch.matmul(q.transpose(2, 3), k_sel.transpose(-1, -2)) * scale  # [B, H_kv, T, G, width]
    if keep is None:
        p = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    else:
        p = masked_softmax(scores, keep[:, None, :, None])
    o = torch.matmul(p.to(v.dtype), v_sel)  # [B, H_kv, T, G, D]
    if keep is not None:  # a row with no pick at all: zeros, whatever its filler row holds
        o = torch.where(keep.any(-1)[:, None, :, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
    return o.transpose(2, 3).contiguous()  # [B, H_kv, G, T, D]


def topk_indices(
    scores: torch.Tensor, k: int, positions: Optional[torch.Tensor] = None, need_keep: bool = True
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The ``k`` largest entries along the last dim, exactly and deterministically:
    (index long [..., k'], keep bool [..., k']) with k' = min(k, n), ordered by score, then
    position, both descending. ``keep`` is False for -inf entries (masked out; they are
    picked only when fewer than k entries are finite); None when ``need_keep`` is False
    (a caller whose rows are all finite).

    Tie rule: among equal scores the later position wins (-0.0 and 0.0 are equal), so a
    query's choice depends neither on how many later, masked entries its row has (a full
    forward's row versus a decoding step's) nor on the order a kernel visits them.
    Implemented as one ``topk`` over distinct int64 keys: the score's order-preserving int32
    (float32; bfloat16 and float16 convert exactly) as the high word and the position as the
    low word, packed by stacking the two int32 words and viewing them as one int64 (4 integer
    ops and one stack; no int64 arithmetic), so the kernel never sees a tie. ``positions``:
    an int32 ``arange`` of at least n entries to reuse (a decoding state keeps one), else one
    is built. float64 scores do not fit a 64-bit key with the position: they take a stable
    sort of the reversed row (same result, O(n log n)). Scores must not be NaN.
    """
    n = scores.shape[-1]
    k = min(k, n)
    if scores.dtype == torch.float64:
        reversed_order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
        index = (n - 1) - reversed_order  # stable on the reversed row: the later of equals first
        return index, (scores.gather(-1, index) > float("-inf")) if need_keep else None
    key = order_key(scores, positions)
    top = torch.topk(key, k, dim=-1, sorted=True)
    if not need_keep:
        return top.indices, None
    high = top.values.view(torch.int32)[..., _HIGH_WORD::2]  # the ordered score of each pick
    return top.indices, high > _ORDERED_NEG_INF


def order_key(scores: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 keys [..., n] whose order is (score, position): the high 32 bits are the score
    as an int32 in float order with -0.0 equal to 0.0, the low 32 bits its position."""
    bits = scores.float().view(torch.int32)
    sign = bits >> 31  # -1 for negative floats (and -0.0), else 0
    ordered = ((bits & 0x7FFFFFFF) ^ sign) - sign  # sign-magnitude -> two's complement: -|x| for x < 0, -0.0 -> 0
    n = scores.shape[-1]
    if positions is None:
        positions = torch.arange(n, dtype=torch.int32, device=scores.device)
    low = positions[:n].expand(ordered.shape)
    return torch.stack([low, ordered] if _LITTLE_ENDIAN else [ordered, low], dim=-1).view(torch.int64).squeeze(-1)


_LITTLE_ENDIAN = sys.byteorder == "little"
_HIGH_WORD = 1 if _LITTLE_ENDIAN else 0  # where an int64's high int32 lies
#: ``order_key``'s high word for -inf: below every finite score's
_ORDERED_NEG_INF = -0x7F800000


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the ``k`` largest entries along the last dim, ignoring -inf entries;
    :func:`topk_indices`'s choice and tie rule (the later of equal scores wins)."""
    index, keep = topk_indices(scores, k)
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter(-1, index, keep)
