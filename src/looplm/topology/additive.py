"""Fixed additive topologies: h^(t+1) = f_core(h^(t)) + h_sup^(t) (MeSH Eq. 1, Alg. 1).

``base`` adds nothing, ``residual`` adds h^(t), ``anchor`` adds h^(0) (the prelude output),
``anchor_embedding`` (anchor*) adds h_emb; ``additive`` sums several of them (MeSH
Appendix E.3's fixed combinations, e.g. +anchor+anchor*).
"""

from __future__ import annotations

import torch

from looplm.accounting.cost import Call, Cost
from looplm.topology.base import LoopState, Topology


class AdditiveTopology(Topology):
    def __init__(self, supplements: tuple[str, ...]):
        super().__init__()
        self.supplements = tuple(supplements)

    def extra_repr(self) -> str:
        return f"supplements={list(self.supplements)}"

    def step(self, state: LoopState, update: torch.Tensor, t: int) -> LoopState:
        h = update  # Eq. (1) with h_sup = 0 (base)
        for name in self.supplements:
            if name == "residual":
                h = h + state.h  # h_sup = h^(t)
            elif name == "anchor":
                h = h + state.carrier["h0"]  # h_sup = h^(0)
            else:
                h = h + state.carrier["h_emb"]  # h_sup = h_emb (anchor*)
        return LoopState(h=h, carrier=state.carrier, record=state.record)

    def flop_cost(self, call: Call) -> Cost:
        if call.phase == "start":
            return Cost()
        return Cost(state=len(self.supplements) * call.rows * call.width)  # one addition per supplement
