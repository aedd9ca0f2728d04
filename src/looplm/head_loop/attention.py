"""Attention of a subset of a layer's heads: the update of SGT's head loop.

sparse-growing-transformer.txt Eq. (6), heads as in Eq. (2): an extra pass computes only
the looping query heads S and the key/value heads they read, through their rows of the
layer's ``qkv`` (and ``gate``) and their columns of ``o_proj``, so its cost scales with
|S|. Slices of the same weights: gradients reach only these heads' rows and columns.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from looplm.mixers.attention import KVState, SoftmaxAttention
from looplm.mixers.base import MixerContext


def head_slices(attn: SoftmaxAttention, heads: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """For query heads ``heads`` (ascending): the rows of ``qkv`` [|S|·D + 2·n_kv·D] that
    project them and the n_kv kv heads they read (q, then k, then v), their rows of
    ``gate`` / columns of ``o_proj`` [|S|·D], and each query head's index among the kept
    kv heads [|S|] (None when query head n reads kept kv head n, as under MHA)."""
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    group = H // Hkv
    kv = sorted({i // group for i in heads})
    dims = torch.arange(D)
    cols = torch.cat([i * D + dims for i in heads])
    rows = torch.cat([cols] + [H * D + j * D + dims for j in kv] + [(H + Hkv) * D + j * D + dims for j in kv])
    kv_index = [kv.index(i // group) for i in heads]
    same = kv_index == list(range(len(heads)))
    return rows.to(device), cols.to(device), None if same else torch.tensor(kv_index, device=device)


def head_subset_attention(
    attn: SoftmaxAttention, x: torch.Tensor, ctx: MixerContext, heads: tuple[int, ...],
    weights: Optional[tuple[float, ...]] = None, state: Optional[KVState] = None,
) -> tuple[torch.Tensor, KVState]:
    """Σ_{i∈S} w_i · Attn^(i)(x) over the query heads S = ``heads`` (ascending) of ``attn``
    (Eq. 6). No output bias (Eq. 2 has none per head). weights: [|S|] output scales (a
    fading head), None for ones. x: [B, T, d] -> ([B, T, d], state holding the used
    key/value heads only)."""
    rows, cols, kv_index = head_slices(attn, heads, x.device)
    kv = (len(rows) - len(cols)) // 2  # n_kv·D rows each for k and v
    bias = None if attn.qkv.bias is None else attn.qkv.bias[rows]
    q, k, v = F.linear(x, attn.qkv.weight[rows], bias).split([len(cols), kv, kv], dim=-1)
    y, new_state = attn.attend(q, k, v, ctx, state, kv_index)  # [B, T, |S|·D]
    if attn.gate is not None:  # LT2 §4.4's output gate, these heads' rows
        bias = None if attn.gate.bias is None else attn.gate.bias[cols]
        y = y * torch.sigmoid(F.linear(x, attn.gate.weight[cols], bias))
    if weights is not None:  # fading heads: scale each head's output before W_O
        y = y * torch.tensor(weights, dtype=y.dtype, device=y.device).repeat_interleave(attn.head_dim)
    return F.linear(y, attn.o_proj.weight[:, cols]), new_state
