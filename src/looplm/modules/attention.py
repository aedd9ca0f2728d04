"""Causal softmax self-attention through ``F.scaled_dot_product_attention``."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.cache import KVSlot
from looplm.modules.rotary import apply_rotary


class CausalSelfAttention(nn.Module):
    """Multi-head (optionally grouped-query) attention with rotary embeddings.

    ``qkv`` projects to [q (H·D) | k (H_kv·D) | v (H_kv·D)]; ``out`` is the output
    projection W_O (scaled at init by the unrolled depth, see ``looplm.init``).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, bias: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)
        self.out = nn.Linear(n_heads * self.head_dim, dim, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: Optional[torch.Tensor],
        kv: Optional[KVSlot] = None,
    ) -> torch.Tensor:
        """x: [B, T, d]; rope: cos/sin [B, T, R]; mask: None (plain causal) or bool
        [B, 1, T, S] (True = may attend); kv: this (block, iteration)'s cache slot."""
        B, T, _ = x.shape
        D = self.head_dim
        q, k, v = self.qkv(x).split([self.n_heads * D, self.n_kv_heads * D, self.n_kv_heads * D], dim=-1)
        q = q.view(B, T, self.n_heads, D).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, self.n_kv_heads, D).transpose(1, 2)  # [B, H_kv, T, D]
        v = v.view(B, T, self.n_kv_heads, D).transpose(1, 2)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if kv is not None:
            k, v = kv.update(k, v)  # [B, H_kv, S, D]
        if self.n_kv_heads != self.n_heads:
            repeat = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        # mask None: queries are the last T of S keys and need only causality; with a
        # single query that is no mask at all.
        causal = mask is None and T > 1
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_heads * D))
