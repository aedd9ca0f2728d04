"""Pre-norm transformer block: norm -> attention -> residual -> norm -> FFN -> residual."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from looplm.cache import KVSlot
from looplm.model_config import ModelConfig
from looplm.modules.attention import CausalSelfAttention
from looplm.modules.mlp import build_mlp
from looplm.modules.norm import build_norm


class Block(nn.Module):
    """Sequential: x + attn(n1(x)), then + ffn(n2(·)). Parallel (GPT-NeoX):
    x + attn(n1(x)) + ffn(n2(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.parallel_residual = cfg.parallel_residual
        self.attn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.bias)
        self.ffn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = build_mlp(cfg.mlp, cfg.d_model, cfg.ffn_hidden, cfg.bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: Optional[torch.Tensor],
        kv: Optional[KVSlot] = None,
    ) -> torch.Tensor:
        """x: [B, T, d] -> [B, T, d]."""
        attended = self.attn(self.attn_norm(x), rope, mask, kv)
        if self.parallel_residual:
            return x + attended + self.ffn(self.ffn_norm(x))
        x = x + attended
        return x + self.ffn(self.ffn_norm(x))
