"""Graves' adaptive computation time over macro steps (Graves 2016; LT2 App. "Adaptive
Computation Time", Eqs. halting-prob and halting-rule; UT's per-position ACT)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost, Step, module_cost
from looplm.halting.base import Halting, HaltState, ReadLogits, Readout, masked_mean


class ACTHalting(Halting):
    """p_t^(τ) = σ(wᵀh_t^(τ) + b); N_t = min{τ : Σ_{τ'≤τ} p ≥ 1 − ε} (capped at the last
    step); weights p_τ for τ < N and R = 1 − Σ_{τ<N} p_τ at N, so they sum to one; readout
    Σ_τ w_τ h^(τ); ponder cost ρ_t = N_t + R_t (Graves Eq. 11), weighted and averaged over
    real positions. With ``full_compute`` no position is frozen and ρ is not charged."""


    def __init__(self, d_model: int, epsilon: float, ponder_cost: float, full_compute: bool, init_bias: float = 1.0):
        super().__init__()
        self.unit = nn.Linear(d_model, 1)
        self.init_bias = init_bias
        self.epsilon, self.ponder_cost, self.full_compute = epsilon, ponder_cost, full_compute
        self.freezes = not full_compute

    def extra_repr(self) -> str:
        return f"epsilon={self.epsilon}, ponder_cost={self.ponder_cost}, full_compute={self.full_compute}"

    def begin(self, h: torch.Tensor, valid: torch.Tensor) -> HaltState:
        state = super().begin(h, valid)
        zeros = torch.zeros(h.shape[:2], device=h.device)
        state.extra = {"cum": zeros, "remainder": zeros, "n": zeros}  # Σp before halting, R, N
        state.readout = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        return state

    def observe(self, state: HaltState, y: torch.Tensor, t: int, last: bool, read_logits: ReadLogits,
                targets: Optional[torch.Tensor]) -> None:
        p = torch.sigmoid(self.unit(y).squeeze(-1).float())  # Eq. halting-prob: [B, T]
        open_ = ~state.halted  # positions whose halting distribution is still open
        cum = state.extra["cum"]
        stop = open_ if last else open_ & (cum + p >= 1.0 - self.epsilon)  # Eq. halting-rule
        remainder = 1.0 - cum
        weight = torch.where(stop, remainder, torch.where(open_, p, torch.zeros_like(p)))
        state.readout = state.readout + weight.unsqueeze(-1) * y.float()
        state.extra["cum"] = cum + torch.where(open_ & ~stop, p, torch.zeros_like(p))
        state.extra["remainder"] = torch.where(stop, remainder, state.extra["remainder"])
        state.extra["n"] = state.extra["n"] + open_.float()
        state.steps = state.steps + state.running.long()
        state.halted = state.halted | stop
        state.record.setdefault("act_weights", []).append(weight.detach())
        if self.freezes:
            state.running = ~state.halted

    def finish(self, state: HaltState) -> torch.Tensor:
        if not self.full_compute and self.ponder_cost > 0:
            ponder = state.extra["n"] + state.extra["remainder"]  # ρ = N + R
            state.losses["ponder"] = self.ponder_cost * masked_mean(ponder, state.valid)
        return state.readout

    def reset_parameters(self, init_std: float) -> None:
        nn.init.normal_(self.unit.weight, std=init_std)
        nn.init.constant_(self.unit.bias, self.init_bias)  # default 1.0, UT's: p ≈ 0.73 at the start

    def step_calls(self, t: int, call: Call, readout: Readout, targets: bool) -> list[Step]:
        return [Step("halting", f"halting.{t}", self, call)]

    def flop_cost(self, call: Call) -> Cost:
        """One macro step: the halting unit d -> 1 (with its bias) on every position, and the
        readout accumulation readout + w·h (a multiply and an add per element)."""
        return module_cost(self.unit, call) + Cost(state=2 * call.rows * self.unit.in_features)
