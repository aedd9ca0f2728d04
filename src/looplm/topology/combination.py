"""Learnable combinations of MeSH Appendix E.3.

h^(t+1) = α1 f_core(h^(t)) + α2 h^(0) + α3 h_emb + α4 h^(t): the base, anchor, anchor*
and residual states of Eq. (1) weighted by learned coefficients.

* ``static_combination``: α are trainable scalars per iteration, fixed after training.
* ``dynamic_combination``: α are computed per token at each iteration from the state
  h^(t) that enters the core, by a per-iteration Linear d -> 4.

The paper lists three terms in its formula but names four states (base, anchor, anchor*
and residual); we include all four. Both start at α = (1, 1/3, 1/3, 1/3): the core output
plus one supplement's worth shared equally, and the dynamic variant starts equal to the
static one (zero weights, that bias).
"""

from __future__ import annotations

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost, Step
from looplm.topology.base import LoopState, Topology

_INIT = (1.0, 1 / 3, 1 / 3, 1 / 3)


def _combine(alpha: torch.Tensor, update: torch.Tensor, state: LoopState) -> torch.Tensor:
    """alpha: [..., 4] broadcastable against [B, T, 1]."""
    terms = (update, state.carrier["h0"], state.carrier["h_emb"], state.h)
    return sum(alpha[..., i : i + 1] * term for i, term in enumerate(terms))


class StaticCombinationTopology(Topology):
    def __init__(self, iterations: int):
        super().__init__()
        self.trained_iterations = iterations
        self.alpha = nn.Parameter(torch.tensor([_INIT] * iterations))  # [T, 4]

    def step(self, state: LoopState, update: torch.Tensor, t: int) -> LoopState:
        state.record.setdefault("alpha", []).append(self.alpha[t].detach())
        h = _combine(self.alpha[t], update, state)
        return LoopState(h=h, carrier=state.carrier, record=state.record)

    def reset_parameters(self, init_std: float) -> None:
        with torch.no_grad():
            self.alpha.copy_(torch.tensor([_INIT] * self.alpha.shape[0]))

    def flop_cost(self, call: Call) -> Cost:
        if call.phase == "start":
            return Cost()
        return Cost(state=7 * call.rows * call.width)  # four scalings, three additions


class DynamicCombinationTopology(Topology):
    def __init__(self, dim: int, iterations: int):
        super().__init__()
        self.trained_iterations = iterations
        self.coefficients = nn.ModuleList(nn.Linear(dim, 4) for _ in range(iterations))

    def step(self, state: LoopState, update: torch.Tensor, t: int) -> LoopState:
        alpha = self.coefficients[t](state.h)  # [B, T, 4], from h^(t)
        state.record.setdefault("alpha", []).append(alpha.detach())
        h = _combine(alpha, update, state)
        return LoopState(h=h, carrier=state.carrier, record=state.record)

    def reset_parameters(self, init_std: float) -> None:
        for layer in self.coefficients:
            nn.init.zeros_(layer.weight)
            with torch.no_grad():
                layer.bias.copy_(torch.tensor(_INIT))

    def step_calls(self, t: int, call: Call) -> list[Step]:
        """The coefficients' linear on h^(t) (a weight gradient only where h^(t) carries no
        gradient: the first step of a truncated backward's window), then the combination."""
        return [Step("topology", f"topology.coefficients.{t}", self.coefficients[t], call, input_grad=call.state_grad),
                *super().step_calls(t, call)]

    def flop_cost(self, call: Call) -> Cost:
        """The combination of one step: four scalings and three additions per element (the
        coefficients' linear is a step of its own)."""
        if call.phase == "start":
            return Cost()
        return Cost(state=7 * call.rows * self.coefficients[0].in_features)
