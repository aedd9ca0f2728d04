"""Mixture-of-experts FFN: dropless top-k token-choice routing (Switch, OLMoE).

``model.moe`` replaces the block's FFN by E experts of the block's FFN kind (``model.mlp``:
GELU or SwiGLU, without biases, as OLMoE's) and a router W_r (d -> E, no bias). For a token
x (OLMoE §2, Eq. 1; Switch Transformer Eq. 1-2):

    p = softmax(W_r x)              (in float32)
    S = top-k(p)                    the k experts the token chooses (token choice)
    y = Σ_{i ∈ S} p_i · E_i(x)      (``normalize_weights``: p_i / Σ_{j ∈ S} p_j, as Mixtral)

Dropless: every token reaches all k of its experts, whatever their load (no capacity
factor, MegaBlocks / OLMoE), so a token's output depends on that token alone and the FFN is
causal; decoding equals the full forward. The (token, expert) assignments are sorted by
expert and each expert's rows go through it as one grouped product
(:func:`looplm.ops.grouped.grouped_linear`).

Auxiliary losses, added through :meth:`MixerContext.add_loss` while training (summed over
every MoE call: blocks and loop iterations, as Switch adds one per router):

- ``moe_balance`` (Switch Eq. 4-6; OLMoE §2 L_LB): α · E · Σ_e f_e · P_e, with f_e the
  fraction of the N tokens of the call routed to expert e (one of its k choices, so Σ_e f_e
  = k, as OLMoE's reference code counts it) and P_e the mean router probability of e.
  Uniform routing gives α · k. Over every row of the call, left padding included (training
  batches are packed windows without padding); only P_e carries gradient, as in Switch.
- ``moe_z`` (ST-MoE, Zoph et al. 2022, Eq. 5): β · mean over tokens of
  (log Σ_e exp(W_r x)_e)², which keeps router logits small; off unless ``z_loss_weight > 0``.

Experts are shared by every loop iteration, or (``per_iteration``) one set of router and
experts per iteration of a shared core (the block holds one :class:`MoE` per iteration and
runs set t at iteration t).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost
from looplm.config_base import Config, check
from looplm.ops.grouped import Groups, Kernel, grouped_linear


@dataclasses.dataclass(frozen=True)
class MoEConfig(Config):
    """``model.moe``: experts E, top_k k, ``hidden`` each expert's width (null: the dense
    FFN's, ``model.mlp_hidden`` or its default), ``per_iteration`` one router and expert set
    per loop iteration of the shared core (else shared by all iterations, and by prelude
    and coda blocks each with their own), loss weights α (``balance_loss_weight``, OLMoE
    0.01) and β (``z_loss_weight``, ST-MoE / OLMoE 0.001, default off),
    ``normalize_weights`` (renormalise the top-k probabilities; OLMoE does not),
    ``kernel`` (``auto``: ``torch._grouped_mm`` where it runs, else one product per
    expert, or gathered weights in a compiled step; see :mod:`looplm.ops.grouped`)."""

    experts: int = 8
    top_k: int = 2
    hidden: Optional[int] = None
    per_iteration: bool = False
    balance_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    normalize_weights: bool = False
    kernel: Kernel = "auto"

    def __post_init__(self) -> None:
        check(self.experts >= 2, "model.moe.experts", self.experts, "an integer >= 2")
        check(1 <= self.top_k <= self.experts, "model.moe.top_k", self.top_k,
              f"an integer in [1, experts={self.experts}]")
        check(self.hidden is None or self.hidden >= 1, "model.moe.hidden", self.hidden, "null or an integer >= 1")
        check(self.balance_loss_weight >= 0, "model.moe.balance_loss_weight", self.balance_loss_weight, "a number >= 0")
        check(self.z_loss_weight >= 0, "model.moe.z_loss_weight", self.z_loss_weight, "a number >= 0")
        check(self.kernel in ("auto", "grouped_mm", "loop", "gather"), "model.moe.kernel", self.kernel,
              "'auto', 'grouped_mm', 'loop' or 'gather' (looplm.ops.grouped)")

    def width(self, ffn_hidden: int) -> int:
        """An expert's hidden width h."""
        return ffn_hidden if self.hidden is None else self.hidden

    def parameters_per_set(self, d_model: int, ffn_hidden: int, mlp: str) -> int:
        """Router d·E plus E experts of m·d·h (m = 2 for GELU, 3 for SwiGLU), no biases."""
        return d_model * self.experts + self.experts * _matrices(mlp) * d_model * self.width(ffn_hidden)

    def active_parameters_per_set(self, d_model: int, ffn_hidden: int, mlp: str) -> int:
        """What one token uses: the router and k of the E experts."""
        return d_model * self.experts + self.top_k * _matrices(mlp) * d_model * self.width(ffn_hidden)


def _matrices(mlp: str) -> int:
    return 3 if mlp == "swiglu" else 2


class ExpertLinear(nn.Module):
    """E bias-free linear maps stored as one weight [E, out, in] (each an ``nn.Linear``
    weight), applied to rows sorted by expert. Initialised as the model's linear layers
    (:mod:`looplm.init`)."""

    def __init__(self, experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))

    def forward(self, x: torch.Tensor, groups: Groups, kernel: Kernel) -> torch.Tensor:
        """x: [R, in] sorted by expert (``groups``) -> [R, out]."""
        return grouped_linear(x, self.weight, groups, kernel)


class MoE(nn.Module):
    """Router + E experts of ``mlp`` kind (module docstring). Parameters ``router.weight``
    [E, d], ``up.weight`` / ``gate.weight`` (SwiGLU) [E, h, d], ``down.weight`` [E, d, h]."""

    def __init__(self, cfg: MoEConfig, dim: int, ffn_hidden: int, mlp: str):
        super().__init__()
        hidden = cfg.width(ffn_hidden)
        self.experts, self.top_k, self.kernel = cfg.experts, cfg.top_k, cfg.kernel
        self.normalize_weights = cfg.normalize_weights
        self.balance_loss_weight, self.z_loss_weight = cfg.balance_loss_weight, cfg.z_loss_weight
        self.router = nn.Linear(dim, cfg.experts, bias=False)
        self.gate = ExpertLinear(cfg.experts, dim, hidden) if mlp == "swiglu" else None
        self.up = ExpertLinear(cfg.experts, dim, hidden)
        self.down = ExpertLinear(cfg.experts, hidden, dim)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, d] -> router logits and probabilities p [N, E] (float32), the weights p_i
        [N, k] (float32) and experts S [N, k] of every token."""
        logits = self.router(x).float()
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize_weights:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights, experts

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        """x: [..., d] -> [..., d]. ``ctx`` (a MixerContext): where the auxiliary losses go
        while training; None adds none."""
        shape, d, k = x.shape, x.shape[-1], self.top_k
        x = x.reshape(-1, d)  # [N, d]
        logits, probs, weights, experts = self.route(x)
        flat = experts.reshape(-1)  # [N·k], assignment j = token j // k
        by_expert, order = torch.sort(flat, stable=True)  # assignments grouped by expert
        experts_ids = torch.arange(self.experts, device=x.device, dtype=flat.dtype)
        offsets = torch.searchsorted(by_expert, experts_ids, right=True, out_int32=True)  # [E] end row per expert
        groups, kernel = Groups(offsets, by_expert), self.kernel
        rows = x.index_select(0, order // k)  # [N·k, d] each assignment's token, sorted by expert
        if self.gate is not None:  # SwiGLU: down(SiLU(gate x) ⊙ up x)
            h = F.silu(self.gate(rows, groups, kernel)) * self.up(rows, groups, kernel)
        else:
            h = F.gelu(self.up(rows, groups, kernel))
        out = self.down(h, groups, kernel)  # [N·k, d] sorted
        y = torch.empty_like(out).index_copy_(0, order, out).view(*shape[:-1], k, d)  # back to [..., k, d]
        y = (y * weights.to(y.dtype).view(*shape[:-1], k, 1)).sum(dim=-2)  # Σ_{i∈S} p_i E_i(x), not a view
        if ctx is not None and self.training:
            self._add_losses(ctx, logits, probs, flat)
        return y

    def _add_losses(self, ctx, logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor) -> None:
        """logits, probs: [N, E]; chosen: [N·k] every token's experts."""
        if self.balance_loss_weight > 0:
            # E · Σ_e f_e P_e with f_e = count_e / N, summed per assignment: (E / N) · Σ_a P_{e(a)}
            mean_prob = probs.mean(dim=0)  # P_e
            balance = mean_prob.index_select(0, chosen).sum() * (self.experts / probs.shape[0])
            ctx.add_loss("moe_balance", self.balance_loss_weight * balance)
        if self.z_loss_weight > 0:
            ctx.add_loss("moe_z", self.z_loss_weight * torch.logsumexp(logits, dim=-1).square().mean())  # ST-MoE Eq. 5

    def flop_cost(self, call: Call) -> Cost:
        """Active parameters only: the router (d·E MACs per token) and the k experts each
        token reaches (k · m · d · h, m = 2 GELU / 3 SwiGLU). Softmax, top-k, sorting and
        the weighted sum are left out, like activations."""
        E, d, hidden = self.down.weight.shape  # [E, out = d, in = h]
        matrices = 3 if self.gate is not None else 2
        return Cost(mac=call.rows * (d * E + self.top_k * matrices * d * hidden))


def build_moe(cfg: MoEConfig, dim: int, ffn_hidden: int, mlp: str, sets: int) -> nn.Module:
    """One :class:`MoE`, or ``sets`` > 1 of them (one per loop iteration) in a ModuleList."""
    if sets == 1:
        return MoE(cfg, dim, ffn_hidden, mlp)
    return nn.ModuleList(MoE(cfg, dim, ffn_hidden, mlp) for _ in range(sets))

