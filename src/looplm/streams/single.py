"""The loop body: which states one macro step updates, with which core passes.

A streams object describes its macro step as data (:class:`CorePass` per core pass) and
runs that description in ``step``; ``step_calls`` beside it lists the module calls of the
same step for the execution plan (``looplm.accounting.plan``), which the plan-order test
(tests/accounting/test_plan_order.py) holds to the forward's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import nn

from looplm.accounting.cost import Call, Step
from looplm.topology.base import LoopState, Topology

#: core(x, i): the core stack on input x [B, T, d] as the i-th block pass of this macro step
Core = Callable[[torch.Tensor, int], torch.Tensor]
#: core_calls(i): the module calls of core(x, i), as the execution plan lists them
CoreCalls = Callable[[int], list[Step]]


@dataclasses.dataclass(frozen=True)
class CorePass:
    """The ``index``-th core pass of a macro step. ``reads``: the stream sum its input is,
    None for the state h itself (two streams: ``"reason"`` X + Y + Z, ``"solve"`` Y + Z).
    ``grad``: whether training backpropagates through it (False under TRM's no-grad cycles)."""

    index: int
    reads: Optional[str] = None
    grad: bool = True


class SingleStream(nn.Module):
    """One state h: update = f_core(x (+ e_t)) on the topology's core input x (h itself, or
    Huginn's A([s, e])), folded in by the topology (UT, MeSH, ...)."""

    schedule = (CorePass(0),)  # the core passes of one macro step
    passes = len(schedule)
    #: whether a macro step's output reaches the next step only through a pass without
    #: gradient (two streams' no-grad cycles), which cuts the backward between steps
    detaches_steps = False

    def start(self, topology: Topology, h_emb: torch.Tensor, h_pre: torch.Tensor) -> LoopState:
        return topology.start(h_emb, h_pre)

    def step(self, topology: Topology, state: LoopState, core: Core, t: int) -> LoopState:
        return topology.step(state, core(topology.core_input(state, t), 0), t)

    def start_calls(self, topology: Topology, call: Call) -> list[Step]:
        """The calls of :meth:`start`: the topology's start."""
        return topology.start_calls(call)

    def step_calls(self, topology: Topology, t: int, call: Call, core: CoreCalls) -> list[Step]:
        """The calls of :meth:`step`: the topology's preparation of the core's input (if any),
        the core pass, then the topology step."""
        return [*topology.input_calls(t, call), *core(0), *topology.step_calls(t, call)]

    def finish(self, topology: Topology, state: LoopState) -> torch.Tensor:
        return topology.finish(state)

    def reset_parameters(self, init_std: float) -> None:
        """Initialise own parameters (called by the model's init pass)."""


def freeze(old: LoopState, new: LoopState, running: torch.Tensor) -> LoopState:
    """``new`` where ``running`` [B, T], ``old`` elsewhere: halted positions keep every
    per-position tensor of the state (h and the carrier) unchanged."""

    def pick(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.shape[:2] != running.shape:
            return b
        return torch.where(running.view(*running.shape, *([1] * (a.dim() - 2))), b, a)

    carrier = {k: pick(old.carrier[k], v) if k in old.carrier else v for k, v in new.carrier.items()}
    return LoopState(h=pick(old.h, new.h), carrier=carrier, record=new.record)
