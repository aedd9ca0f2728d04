"""The topology interface U(update, state, carrier, t) -> (state, carrier).

A topology decides how the core's output f_core(h^(t)) enters the loop state. It owns
its parameters (routers, gates) but never its carrier: the anchor h^(0), the embeddings
and the values MeSH has written travel in a :class:`LoopState` that the loop driver
passes along, so the same module can serve every iteration and every batch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import nn

from looplm.accounting.cost import Call, Step


@dataclasses.dataclass
class LoopState:
    """h: the state h^(t) the next core pass reads, [B, T, d].
    carrier: what the topology keeps besides h (h^(0), h_emb, the values MeSH wrote).
    record: per-iteration values for callers (e.g. router weights), lists in iteration order.
    """

    h: torch.Tensor
    carrier: dict[str, torch.Tensor]
    record: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "LoopState":
        """``fn`` applied to h and every carrier tensor (e.g. to select positions); no record."""
        return LoopState(fn(self.h), {k: fn(v) for k, v in self.carrier.items()})


class Topology(nn.Module):
    """Base class. ``trained_iterations`` is None when any iteration count works at
    inference (no per-iteration parameters), else the count the parameters exist for."""

    trained_iterations: Optional[int] = None

    def start(self, h_emb: torch.Tensor, h_pre: torch.Tensor) -> LoopState:
        """State entering the loop from the embeddings h_emb and the prelude output h_pre."""
        return LoopState(h=h_pre, carrier={"h0": h_pre, "h_emb": h_emb})

    def core_input(self, state: LoopState, t: int) -> torch.Tensor:
        """What the core reads at iteration t: the state h itself, unless the topology
        prepares it (Huginn's adapter on [s, e], :mod:`looplm.topology.concat_adapter`)."""
        return state.h

    def step(self, state: LoopState, update: torch.Tensor, t: int) -> LoopState:
        """Next state from ``update`` = f_core(state.h) at iteration t (0-based)."""
        raise NotImplementedError

    def finish(self, state: LoopState) -> torch.Tensor:
        """h^(K), the state handed to the coda."""
        return state.h

    def reset_parameters(self, init_std: float) -> None:
        """Initialise own parameters (called by the model's init pass)."""

    def start_calls(self, call: Call) -> list[Step]:
        """What :meth:`start` runs, as the execution plan lists it (``call``: the full forward)."""
        return [Step("topology", "topology.start", self, dataclasses.replace(call, phase="start"))]

    def input_calls(self, t: int, call: Call) -> list[Step]:
        """What :meth:`core_input` runs at iteration t (none unless a subclass prepares the input)."""
        return []

    def step_calls(self, t: int, call: Call) -> list[Step]:
        """What :meth:`step` runs at iteration t (``call``: the full forward at iteration t).
        Its cost is the subclass's ``flop_cost`` for ``phase="step"``."""
        return [Step("topology", f"topology.step.{t}", self, call)]
