"""Gated linear attention (Yang et al. 2024): a data-dependent diagonal decay,

    S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ,   log α_t = logsigmoid(W_2 W_1 x_t + b) / τ     (LT2 Table 1)

with a low-rank gate projection (rank 16) and τ = ``gate_logit_normalizer`` (16). The
layer is flash-linear-attention's ``fla.layers.GatedLinearAttention`` (parameter names
included): q/k/v projections (optional short convolutions), gk_proj, the GLA op with
scale 1/√K, a per-head RMSNorm of o gated by SiLU(g_proj(x)) and o_proj.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.config_base import check
from looplm.mixers.base import MixerContext
from looplm.mixers.linear_attention import DecayMixer, DecayState, GatedDecayConfig, repeat_kv
from looplm.modules.shape import BlockShape


class GatedLinearAttention(DecayMixer):
    """fla's ``GatedLinearAttention`` layer.

    key_dim = hidden·expand_k (fla's default 0.5), value_dim = hidden·expand_v over
    num_heads; k, v and the gate over num_kv_heads (grouped). gk_proj = Linear(hidden,
    gate_low_rank_dim) then Linear(·, key_dim / groups, bias); ``clamp_min`` bounds log α
    from below. ``use_output_gate``: o ← RMSNorm(o)·SiLU(g_proj(x)).
    Shapes: x [B, T, hidden] -> [B, T, hidden]; state S [B, H, head_k_dim, head_v_dim].
    """

    kind = "gla"
    decay_gate = "channel"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 4,
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        num_kv_heads: Optional[int] = None,
        use_short_conv: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        use_output_gate: bool = True,
        norm_eps: float = 1e-5,
        gate_logit_normalizer: float = 16,
        gate_low_rank_dim: int = 16,
        clamp_min: Optional[float] = None,
        chunk_size: int = 64,
    ):
        super().__init__()
        self.set_heads(hidden_size, num_heads, num_kv_heads, expand_k, expand_v)
        self.chunk_size, self.gate_logit_normalizer, self.clamp_min = chunk_size, gate_logit_normalizer, clamp_min
        self.add_gated_layer(hidden_size, use_short_conv, conv_size, conv_bias, use_output_gate, norm_eps)
        self.gk_proj = nn.Sequential(
            nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
            nn.Linear(gate_low_rank_dim, self.key_dim // self.groups, bias=True),
        )

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[DecayState] = None
    ) -> tuple[torch.Tensor, DecayState]:
        """x: [B, T, hidden] -> ([B, T, hidden], state after these T positions)."""
        B, T, _ = x.shape
        valid = ctx.new_valid if ctx.padded else None  # [B, T]; False on left padding
        (q, k, v), new_conv = self.project(x, None if state is None else state.conv, valid)
        q, k, v = self.split_heads(q, k, v)
        gk = repeat_kv(self.gk_proj(x).view(B, T, self.num_kv_heads, self.head_k_dim), self.groups)
        log_alpha = F.logsigmoid(gk.float()) / self.gate_logit_normalizer  # [B, T, H, K]
        if self.clamp_min is not None:
            log_alpha = log_alpha.clamp(min=self.clamp_min)
        k, log_alpha = self.mask_padding(valid, k, log_alpha)
        o, S = self.decay(q, k, v, log_alpha, None, None if state is None else state.recurrent)
        return self.gated_output(o, x), DecayState(S, new_conv, ctx.valid.shape[1])


@dataclasses.dataclass(frozen=True)
class GLAConfig(GatedDecayConfig):
    """GLA (fla ``GatedLinearAttention``): key/value widths d_model·expand_k /
    d_model·expand_v (default 0.5 and 1); ``num_kv_heads`` null: the model's kv heads."""

    kind: str = "gla"
    expand_k: float = 0.5
    gate_logit_normalizer: float = 16.0
    gate_low_rank_dim: int = 16
    clamp_min: Optional[float] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.gate_logit_normalizer > 0, "model.mixer.gate_logit_normalizer", self.gate_logit_normalizer,
              "a number > 0")
        check(self.gate_low_rank_dim >= 1, "model.mixer.gate_low_rank_dim", self.gate_low_rank_dim, "an integer >= 1")
        check(self.clamp_min is None or self.clamp_min < 0, "model.mixer.clamp_min", self.clamp_min,
              "null or a number < 0 (a lower bound on log α)")

    def build(self, shape: BlockShape) -> nn.Module:
        heads, kv_heads = self.head_counts(shape)
        return GatedLinearAttention(
            shape.d_model, heads, self.expand_k, self.expand_v, num_kv_heads=kv_heads,
            use_short_conv=self.use_short_conv, conv_size=self.conv_size, conv_bias=self.conv_bias,
            use_output_gate=self.use_output_gate, norm_eps=self.norm_eps,
            gate_logit_normalizer=self.gate_logit_normalizer, gate_low_rank_dim=self.gate_low_rank_dim,
            clamp_min=self.clamp_min, chunk_size=self.chunk_size,
        )
