"""Softmax attention over grouped key/value heads (GQA) without copying them to every query head.

A layer with H query heads over H_kv < H key/value heads (query head h reads kv head
h // (H / H_kv)) used to hand SDPA K and V repeated to H heads: a copy of each forward, a
sum of their gradients backward, and in decoding a copy of the whole cache per step. The
attention layers (:mod:`looplm.mixers.attention`) and DSA's dense prefill
(:mod:`looplm.ops.sparse.dsa`) read the grouped heads in place wherever a kernel takes them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def reads_grouped_heads(q: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether SDPA reads grouped key/value heads itself (``enable_gqa``) for queries ``q``
    [B, H, T, D] at several positions (one is folded: :func:`attend_grouped`) under ``mask``,
    instead of from copies repeated to H heads (a copy of K and V forward, a sum of their
    gradients backward). PyTorch's kernels that take grouped heads:
    the CPU flash kernel, any mask and dtype (the same values as over the copies); on CUDA
    the flash kernel only, so a GPU of compute capability 8.0 or newer, half precision, head
    size a multiple of 8 up to 256 and no mask (else SDPA would run its math kernel, slower
    than the copies)."""
    if q.device.type == "cpu":
        return True
    return (q.device.type == "cuda" and mask is None and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and _runs_flash(q.device.index))


@torch.compiler.assume_constant_result
def _runs_flash(index: int) -> bool:
    """Whether CUDA device ``index`` has SDPA's flash kernel (Ampere, compute capability 8.0, on)."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def attend_grouped(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor],
                   is_causal: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """SDPA of queries q [B, H, T, D] over keys and values of H or of H_kv grouped heads
    [B, H_kv, S, D] (query head h reads kv head h // (H / H_kv)) under ``mask`` [B, 1, T, S]
    (None: ``is_causal`` or none; ``scale``: SDPA's, None for 1/√D) -> [B, H, T, D_v]. One query position (a decoding step)
    folds each group's G = H / H_kv query heads into the query axis, [B, H_kv, G, D]: an MHA
    call over the cache as it is, which every kernel takes, masked or not, so no step copies
    the cache to H heads; several positions read grouped heads through ``enable_gqa``
    (:func:`reads_grouped_heads` says where)."""
    B, H, T, D = q.shape
    Hkv = keys.shape[1]
    if Hkv != H and T == 1:
        y = F.scaled_dot_product_attention(q.reshape(B, Hkv, H // Hkv, D), keys, values, attn_mask=mask, scale=scale)
        return y.reshape(B, H, 1, values.shape[-1])
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=Hkv != H)
