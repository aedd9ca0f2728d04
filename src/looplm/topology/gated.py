"""LT2's learned per-loop residual (lt2.txt §2.1).

h^(τ) = h̃^(τ) + ρ_τ ⊙ h^(τ-1), with ρ_τ ∈ R^d zero-initialised per iteration, so the
loop starts as ``base`` and learns how much of the previous state to carry.
"""

from __future__ import annotations

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost
from looplm.topology.base import LoopState, Topology


class GatedResidualTopology(Topology):
    def __init__(self, dim: int, iterations: int):
        super().__init__()
        self.trained_iterations = iterations
        self.rho = nn.Parameter(torch.zeros(iterations, dim))  # [T, d]

    def step(self, state: LoopState, update: torch.Tensor, t: int) -> LoopState:
        h = torch.addcmul(update, self.rho[t], state.h)  # f(h) + ρ_t ⊙ h in one operator
        return LoopState(h=h, carrier=state.carrier, record=state.record)

    def reset_parameters(self, init_std: float) -> None:
        nn.init.zeros_(self.rho)

    def flop_cost(self, call: Call) -> Cost:
        if call.phase == "start":
            return Cost()
        return Cost(state=2 * call.rows * self.rho.shape[1])  # ρ ⊙ h, + f(h)
