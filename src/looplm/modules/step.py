"""Step conditioning: a learned vector per macro step (Universal Transformers; the
"Iterative Step" rung of autoregressive-trm.txt Table 1: H^(k+1) = f(H^(k) + e_k))."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost, Step


class StepEmbedding(nn.Module):
    """e_t [d] for t < ``steps``. ``enabled = False`` switches it off (the model then runs
    without a step signal), which is how a tied model extrapolates to more iterations at
    inference than it was trained with (App. B.2)."""

    def __init__(self, steps: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(steps, d_model))
        self.enabled = True

    def extra_repr(self) -> str:
        return f"steps={self.weight.shape[0]}, enabled={self.enabled}"

    def at(self, t: int) -> Optional[torch.Tensor]:
        """e_t, or None when switched off. A method, not ``forward``: a module call
        returning a view of a parameter trips FlopCounterMode's module hooks under no_grad."""
        return self.weight[t] if self.enabled else None

    def reset_parameters(self, init_std: float) -> None:
        nn.init.normal_(self.weight, std=init_std)

    def step_calls(self, t: int, slot: int, call: Call) -> list[Step]:
        """What :meth:`at` adds to a core pass's input (x + e_t, at full resolution): nothing
        when switched off."""
        return [Step("step_embedding", f"step_embedding.{slot}", self, call)] if self.enabled else []

    def flop_cost(self, call: Call) -> Cost:
        return Cost(bias=call.rows * self.weight.shape[1])  # x + e_t on one core pass's input: a learned vector added
