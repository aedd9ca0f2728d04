"""Pre-norm transformer block: norm -> token mixer -> residual -> norm -> FFN -> residual."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from looplm.mixers import MixerContext, MixerState
from looplm.model_config import ModelConfig
from looplm.modules.mlp import build_mlp
from looplm.modules.norm import build_norm


class Block(nn.Module):
    """Sequential: x + mix(n1(x)), then + ffn(n2(·)). Parallel (GPT-NeoX):
    x + mix(n1(x)) + ffn(n2(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.parallel_residual = cfg.parallel_residual
        self.attn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = cfg.mixer.build(cfg)  # named as in fla's layers, whatever the mixer
        self.ffn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = build_mlp(cfg.mlp, cfg.d_model, cfg.ffn_hidden, cfg.bias)

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[MixerState] = None
    ) -> tuple[torch.Tensor, MixerState]:
        """x: [B, T, d] -> ([B, T, d], the mixer's state after these positions)."""
        mixed, state = self.attn(self.attn_norm(x), ctx, state)
        if self.parallel_residual:
            return x + mixed + self.ffn(self.ffn_norm(x)), state
        x = x + mixed
        return x + self.ffn(self.ffn_norm(x)), state
