"""RetNet's multi-scale retention (Sun et al. 2023): linear attention with a fixed decay
per head,

    S_t = γ_h S_{t-1} + k_t v_tᵀ,   γ_h = 1 - 2^(-5-h),   o_t = S_tᵀ q_t / √K     (LT2 Table 1)

The layer is flash-linear-attention's ``fla.layers.MultiScaleRetention`` (parameter names
included): q/k/v projections (optional short convolutions), rotary embeddings on q and
k, the retention op, a per-head RMSNorm of o gated by SiLU(g_proj(x)) (fla's fused
``g_norm_swish_gate``; a plain ``g_norm`` without the output gate) and o_proj.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from looplm.config_base import check
from looplm.mixers.base import MixerContext
from looplm.mixers.linear_attention import DecayMixer, DecayState, GatedDecayConfig, positions
from looplm.modules.rotary import Rotary, apply_rotary
from looplm.modules.shape import BlockShape


def retention_log_decay(num_heads: int) -> torch.Tensor:
    """log γ_h = log(1 - 2^(-5-h)) for h = 0 .. H-1 (RetNet §2.2; fla ``chunk_retention``)."""
    return torch.log(1 - 2.0 ** (-5.0 - torch.arange(num_heads, dtype=torch.float64))).float()


class MultiScaleRetention(DecayMixer):
    """fla's ``MultiScaleRetention`` layer.

    key_dim = hidden·expand_k, value_dim = hidden·expand_v (fla's default 2) over num_heads;
    k and v over num_kv_heads (grouped). ``use_short_conv``: SiLU short convolutions on
    q, k, v. ``use_output_gate``: o ← RMSNorm(o)·SiLU(g_proj(x)). Rotary over the whole
    head_k_dim with base ``rope_theta`` (fla: 10000), at the positions of real tokens.
    Shapes: x [B, T, hidden] -> [B, T, hidden]; state S [B, H, head_k_dim, head_v_dim].
    """

    kind = "retnet"
    decay_gate = "head"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 8,
        expand_k: float = 1.0,
        expand_v: float = 2.0,
        num_kv_heads: Optional[int] = None,
        use_short_conv: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        use_output_gate: bool = True,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        chunk_size: int = 64,
    ):
        super().__init__()
        self.set_heads(hidden_size, num_heads, num_kv_heads, expand_k, expand_v)
        if self.head_k_dim % 2:
            raise ValueError(f"head_k_dim={self.head_k_dim} must be even for rotary embeddings")
        self.chunk_size = chunk_size
        self.add_gated_layer(hidden_size, use_short_conv, conv_size, conv_bias, use_output_gate, norm_eps)
        self.rotary = Rotary(self.head_k_dim, rope_theta)
        self.register_buffer("log_gamma", retention_log_decay(num_heads), persistent=False)

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[DecayState] = None
    ) -> tuple[torch.Tensor, DecayState]:
        """x: [B, T, hidden] -> ([B, T, hidden], state after these T positions)."""
        B, T, _ = x.shape
        valid = ctx.new_valid if ctx.padded else None  # [B, T]; False on left padding
        (q, k, v), new_conv = self.project(x, None if state is None else state.conv, valid)
        q, k, v = self.split_heads(q, k, v)
        cos, sin = self.rotary(positions(ctx), q.dtype)  # [B, T, head_k_dim]; the same for every head
        q = apply_rotary(q.transpose(1, 2), cos, sin).transpose(1, 2)
        k = apply_rotary(k.transpose(1, 2), cos, sin).transpose(1, 2)
        log_alpha = self.log_gamma.float().expand(B, T, self.num_heads)  # γ_h, the same at every position
        k, log_alpha = self.mask_padding(valid, k, log_alpha)
        o, S = self.decay(q, k, v, log_alpha, None, None if state is None else state.recurrent)
        return self.gated_output(o, x), DecayState(S, new_conv, ctx.valid.shape[1])


@dataclasses.dataclass(frozen=True)
class RetNetConfig(GatedDecayConfig):
    """RetNet (fla ``MultiScaleRetention``): key/value widths d_model·expand_k /
    d_model·expand_v (default 1 and 2); ``num_kv_heads`` null: the model's kv heads; rotary
    base from the model's ``rope_theta``."""

    kind: str = "retnet"
    expand_v: float = 2.0

    def build(self, shape: BlockShape) -> nn.Module:
        heads, kv_heads = self.head_counts(shape)
        head_k_dim = round(shape.d_model * self.expand_k) // heads
        check(head_k_dim % 2 == 0, "model.mixer.expand_k", self.expand_k,
              f"a factor giving an even head_k_dim for rotary embeddings (got {head_k_dim})")
        return MultiScaleRetention(
            shape.d_model, heads, self.expand_k, self.expand_v, num_kv_heads=kv_heads,
            use_short_conv=self.use_short_conv, conv_size=self.conv_size, conv_bias=self.conv_bias,
            use_output_gate=self.use_output_gate, norm_eps=self.norm_eps, rope_theta=shape.rope_theta,
            chunk_size=self.chunk_size,
        )
