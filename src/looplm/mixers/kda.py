"""Kimi Delta Attention (KDA; Kimi Team 2025, "Kimi Linear"): the delta rule with a
data-dependent decay per key channel.

    S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ          (LT2 Table 1)
    log α_t = -exp(A_log) · softplus(f_proj(x_t) + dt_bias)   ∈ R^K per head

The layer is fla's ``fla.layers.KimiDeltaAttention`` (parameter names included): the
DeltaNet body (:class:`~looplm.mixers.deltanet.DeltaRuleMixer`) with a low-rank f_proj
for the decay, per-head A_log, per-channel dt_bias, and an output RMSNorm gated by
sigmoid of a low-rank g_proj.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.mixers.deltanet import HeadSizedDeltaRuleConfig, MambaDecayDeltaRule
from looplm.modules.norm import GatedRMSNorm
from looplm.modules.shape import BlockShape


class KimiDeltaAttention(MambaDecayDeltaRule):
    """fla's ``KimiDeltaAttention`` layer (value heads = heads, no safe_gate/lower_bound).

    q, k: num_heads × head_dim; v: num_heads × head_dim·expand_v. f_proj: hidden ->
    head_v_dim -> H·head_dim (the decay's low-rank projection); g_proj: hidden ->
    head_v_dim -> value_dim with bias (the output gate).
    """

    kind = "kda"
    decay_gate = "channel"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 16,
        head_dim: int = 128,
        expand_v: float = 1.0,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
    ):
        super().__init__(hidden_size, num_heads, head_dim, expand_v, use_short_conv, conv_size, conv_bias,
                         allow_neg_eigval, chunk_size)
        self.f_proj = nn.Sequential(
            nn.Linear(hidden_size, self.head_v_dim, bias=False), nn.Linear(self.head_v_dim, self.key_dim, bias=False)
        )
        self.add_decay(A_min=1, dt_channels=self.key_dim)  # A ~ U(1, 16), dt per key channel
        self.g_proj = nn.Sequential(
            nn.Linear(hidden_size, self.head_v_dim, bias=False), nn.Linear(self.head_v_dim, self.value_dim, bias=True)
        )
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation="sigmoid")

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """log α_t = -exp(A_log) · softplus(f_proj(x) + dt_bias): [B, T, H, K], float32."""
        B, T, _ = x.shape
        f = (self.f_proj(x).float() + self.dt_bias.float()).view(B, T, self.num_heads, self.head_k_dim)
        return -self.A_log.float().exp()[:, None] * F.softplus(f)

    def gate_rows(self) -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        """β's row, then the first (hidden -> head_v_dim) layers of f_proj and g_proj."""
        return [("b", self.b_proj.weight, None), ("f", self.f_proj[0].weight, None), ("g", self.g_proj[0].weight, None)]

    def derived_gates(self) -> dict[str, torch.Tensor]:
        """f_proj's second layer negated with -dt_bias (it gives -z_t), A = exp(A_log) per channel."""
        return {"f_up": -self.f_proj[1].weight, "f_bias": -self.dt_bias,
                "decay_power": self.A_log.float().exp().repeat_interleave(self.head_k_dim)}

    def step_gates(self, parts, derived):
        """α_t = exp(-A · softplus(z_t)) = σ(-z_t)^A per key channel, β_t = σ(b_t)."""
        B = parts["f"].shape[0]
        minus_z = F.linear(parts["f"], derived["f_up"], derived["f_bias"])  # [B, H·K]
        alpha = torch.sigmoid(minus_z.float()).pow(derived["decay_power"]).view(B, self.num_heads, self.head_k_dim)
        return alpha, torch.sigmoid(parts["b"].float()), parts["g"]

    def output_gate(self, gate: torch.Tensor) -> torch.Tensor:
        return self.g_proj[1](gate)


@dataclasses.dataclass(frozen=True)
class KDAConfig(HeadSizedDeltaRuleConfig):
    """Kimi Delta Attention (fla ``KimiDeltaAttention``). ``head_dim`` null: d_model /
    num_heads; value heads are head_dim·expand_v wide."""

    kind: str = "kda"

    def build(self, shape: BlockShape) -> nn.Module:
        heads, head_dim = self.head_shape(shape)
        return KimiDeltaAttention(shape.d_model, heads, head_dim, self.expand_v, **self.common())
