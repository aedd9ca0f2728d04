"""A per-step exit gate with a cumulative-probability threshold (Ouro: modeling_ouro.py,
``OuroModel.early_exit_gate`` and ``OuroForCausalLM``'s ``exit_threshold`` rule).

Every position runs every step (the later steps of an exited position still feed the
attention of later positions, as in Ouro); the rule only chooses, per position, which
step's state is read out."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from looplm.halting.base import Halting, HaltState, Readout


class ExitGateHalting(Halting):
    """λ_t = σ(wᵀ norm(y_t) + b) on the final-normed state of step t; the exit distribution
    p_t = λ_t ∏_{s<t}(1 − λ_s) for t < T, and p_T the remaining mass (so Σ p = 1); a position
    exits at the first step whose CDF Σ_{s≤t} p_s reaches ``threshold`` (else the last) and
    its readout is y at that step. ``threshold`` 1.0 reads out the last step, unless the
    gate saturates (the CDF reaching 1.0 in floating point: Ouro exits there too); None
    always reads out the last step (Ouro without ``exit_threshold``).
    Records the exit probabilities p_t (``exit_probability``) and each position's exit step
    (``exit_step``). The gate is an inference rule here: a training forward reads out the
    same selected states and gives the gate no gradient."""

    evaluates = True
    reads_norm = True

    def __init__(self, d_model: int, threshold: Optional[float]):
        super().__init__()
        self.gate = nn.Linear(d_model, 1)
        self.threshold = threshold

    def extra_repr(self) -> str:
        return f"threshold={self.threshold}"

    def begin(self, h: torch.Tensor, valid: torch.Tensor) -> HaltState:
        state = super().begin(h, valid)
        ones = torch.ones(h.shape[:2], device=h.device)
        state.extra = {"survive": ones, "cdf": torch.zeros_like(ones),
                       "exit_step": torch.full(h.shape[:2], -1, dtype=torch.long, device=h.device)}
        return state

    def observe(self, state: HaltState, y: torch.Tensor, t: int, last: bool, read_logits: Readout,
                targets: Optional[torch.Tensor]) -> None:
        survive = state.extra["survive"]
        lam = torch.sigmoid(self.gate(read_logits.norm(y)).squeeze(-1).float())  # λ_t: [B, T]
        p = survive if last else lam * survive  # the last step takes the remaining mass
        cdf = state.extra["cdf"] + p
        reached = cdf >= self.threshold if self.threshold is not None else torch.zeros_like(state.halted)
        exits = ~state.halted & (reached | last)
        state.readout = y if state.readout is None else torch.where(exits.unsqueeze(-1), y, state.readout)
        state.extra.update(survive=survive * (1.0 - lam), cdf=cdf,
                           exit_step=torch.where(exits, t, state.extra["exit_step"]))
        state.halted = state.halted | exits
        state.steps = state.steps + state.running.long()  # every position runs every step
        state.record.setdefault("exit_probability", []).append(p.detach())
        if last:
            state.record["exit_step"] = [state.extra["exit_step"]]

    def reset_parameters(self, init_std: float) -> None:
        nn.init.normal_(self.gate.weight, std=init_std)
        nn.init.zeros_(self.gate.bias)
