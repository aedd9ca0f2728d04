"""Pieces shared by the sparse-attention ops: a softmax that tolerates rows with nothing to
attend to, masked attention over grouped query heads, and a top-k with deterministic ties.

Exactness matters more than speed here: prefill + decoding must pick the same keys as one
full forward, so ties in a top-k are broken by position (the later key wins), never by the
order a kernel happens to visit them.
"""

from __future__ import annotations

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


def gathered_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, width: int, scale: float
) -> torch.Tensor:
    """:func:`grouped_attention`'s output when each query row allows at most ``width`` keys,
    reading only those: the allowed keys and values are gathered per query, so the cost is
    O(T·width) per head instead of O(T·S) (a decoding step of DSA touches its top-k keys, not
    the whole cache).

    q: [B, H_kv, G, T, D]; k, v: [B, H_kv, S, D]; allowed: bool [B, T, S] with at most
    ``width`` True per row. Returns o [B, H_kv, G, T, D] in v's dtype.
    """
    B, Hkv, _, T, D = q.shape
    picked = allowed.to(torch.int8).topk(width, dim=-1)  # every allowed key (count <= width), then others
    index, keep = picked.indices, picked.values.bool()  # [B, T, width]
    flat = index.reshape(B, 1, T * width, 1)
    k_sel = torch.gather(k, 2, flat.expand(B, Hkv, T * width, D)).view(B, Hkv, T, width, D)
    v_sel = torch.gather(v, 2, flat.expand(B, Hkv, T * width, v.shape[-1])).view(B, Hkv, T, width, v.shape[-1])
    v_sel = v_sel.masked_fill(~keep[:, None, :, :, None], 0)  # filler picks of short rows contribute nothing
    scores = torch.einsum("bhgtd,bhtwd->bhgtw", q, k_sel) * scale  # [B, H_kv, G, T, width]
    p = masked_softmax(scores, keep[:, None, None])
    return torch.einsum("bhgtw,bhtwd->bhgtd", p.to(v.dtype), v_sel).contiguous()


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the ``k`` largest entries along the last dim, ignoring -inf entries;
    among equal scores the later index wins, so the choice does not depend on how many
    (later, masked) entries the row has or on the kernel's visiting order."""
    n = scores.shape[-1]
    finite = scores > float("-inf")
    if k >= n:
        return finite
    threshold = torch.topk(scores, k, dim=-1).values[..., -1:]  # the k-th largest value (ties agree)
    above = scores > threshold
    need = k - above.sum(dim=-1, keepdim=True)  # slots left for entries equal to the threshold
    tied = scores == threshold
    from_end = tied.flip(-1).long().cumsum(-1).flip(-1)  # tied entries at or after each index
    return (above | (tied & (from_end <= need))) & finite
