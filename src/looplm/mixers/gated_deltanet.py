"""Gated DeltaNet (Yang et al. 2025, "Gated Delta Networks: Improving Mamba2 with Delta
Rule"): the delta rule with a data-dependent scalar decay per head.

    S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ            (LT2 Table 1)
    log α_t = -exp(A_log) · softplus(W_a x_t + dt_bias)              (Mamba2's Δ-discretised decay)

The layer is fla's ``fla.layers.GatedDeltaNet`` (parameter names included): the DeltaNet
body (:class:`~looplm.mixers.deltanet.DeltaRuleMixer`) with a_proj, A_log, dt_bias, and
an output RMSNorm gated by SiLU(g_proj(x)) when ``use_gate``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.mixers.deltanet import HeadSizedDeltaRuleConfig, MambaDecayDeltaRule
from looplm.modules.norm import GatedRMSNorm, RMSNorm
from looplm.modules.shape import BlockShape


class GatedDeltaNet(MambaDecayDeltaRule):
    """fla's ``GatedDeltaNet`` layer (value heads = heads).

    q, k: num_heads × head_dim; v: num_heads × head_dim·expand_v. ``use_gate``: output
    norm gated by SiLU(g_proj(x)) (fla's default), else a plain RMSNorm.
    """

    kind = "gated_deltanet"
    decay_gate = "head"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 6,
        head_dim: int = 256,
        expand_v: float = 2.0,
        use_gate: bool = True,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
    ):
        super().__init__(hidden_size, num_heads, head_dim, expand_v, use_short_conv, conv_size, conv_bias,
                         allow_neg_eigval, chunk_size)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.add_decay(A_min=0, dt_channels=num_heads)  # A ~ U(0, 16), dt per head
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation="swish")
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """log α_t = -exp(A_log) · softplus(a_proj(x) + dt_bias): [B, T, H], float32."""
        return -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())

    def gate_rows(self) -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        """-z_t = -(a_proj(x) + dt_bias) beside b_proj(x) (one sigmoid gives both gates), then g."""
        ab = ("ab", torch.cat([-self.a_proj.weight, self.b_proj.weight]),
              torch.cat([-self.dt_bias, self.dt_bias.new_zeros(self.num_heads)]))
        return [ab, *super().gate_rows()[1:]]  # the base's rows are b (here in ab) and g

    def derived_gates(self) -> dict[str, torch.Tensor]:
        return {"decay_power": self.A_log.float().exp()}

    def step_gates(self, parts, derived):
        """α_t = exp(-A · softplus(z_t)) = σ(-z_t)^A with A = exp(A_log), and β_t = σ(b_t): one
        sigmoid and one power for both gates of a decoding step."""
        H = self.num_heads
        gates = torch.sigmoid(parts["ab"].float())  # [B, 2H]: σ(-z), β
        return gates[:, :H].pow(derived["decay_power"]), gates[:, H:], parts.get("g")

    def fla_fused_step(self, qk, v, parts, recurrent):
        """fla's ``fused_recurrent_gated_delta_rule`` on the raw inputs: the L2 norms of q and
        k, log α_t = -exp(A_log) · softplus(z_t) and β_t = σ(b_t) (doubled when
        ``allow_neg_eigval``) all in the kernel."""
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        H = self.num_heads
        minus_z, b = parts["ab"][:, None, :H], parts["ab"][:, None, H:]  # [B, 1, H] each
        o, S = fused_recurrent_gated_delta_rule(
            q=qk[:, None, :, 0], k=qk[:, None, :, 1], v=v[:, None], g=-minus_z, beta=b,
            scale=self.head_k_dim**-0.5, initial_state=recurrent, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log,
            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval,
        )
        return o[:, 0], S.float()


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig(HeadSizedDeltaRuleConfig):
    """Gated DeltaNet (fla ``GatedDeltaNet``). ``head_dim`` null: d_model / num_heads;
    value heads are head_dim·expand_v wide (fla's default 2)."""

    kind: str = "gated_deltanet"
    expand_v: float = 2.0
    use_gate: bool = True

    def build(self, shape: BlockShape) -> nn.Module:
        heads, head_dim = self.head_shape(shape)
        return GatedDeltaNet(shape.d_model, heads, head_dim, self.expand_v, use_gate=self.use_gate, **self.common())
