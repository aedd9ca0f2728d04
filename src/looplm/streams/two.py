"""Solution and reasoning streams (autoregressive-trm.txt §2.3, App. B.1; TRM)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost, Step, in_pass
from looplm.streams.single import Core, CoreCalls, CorePass
from looplm.topology.base import LoopState, Topology


class TwoStream(nn.Module):
    """X: the loop input (fixed); Y: the solution; Z: the reasoning stream. One macro step:

        for each of H outer cycles:  Z ← f(X + Y + Z)  (L times);  Y ← f(Y + Z)

    H·(L + 1) block passes (App. B "Compute normalization"), listed in ``schedule``. The
    state's ``h`` is Y, what halting reads and the loop hands on; the topology is never
    called (it must be ``base``). Y⁰, Z⁰ (``init``) are learned vectors, fixed random
    vectors (TRM's buffers) or zeros, set anew at every forward: nothing is carried across
    calls, so logits at position i depend only on tokens ≤ i (§3.2, Challenge 2).
    ``no_grad_cycles``: the first H − 1 cycles of every macro step run under
    ``torch.no_grad`` (TRM)."""

    def __init__(self, d_model: int, outer: int, inner: int, init: str, no_grad_cycles: bool):
        super().__init__()
        self.outer, self.inner, self.no_grad_cycles = outer, inner, no_grad_cycles
        self.schedule = tuple(
            CorePass(cycle * (inner + 1) + k, "reason" if k < inner else "solve",
                     grad=not (no_grad_cycles and cycle < outer - 1))
            for cycle in range(outer) for k in range(inner + 1)
        )
        self.passes = len(self.schedule)
        # the first cycle of every macro step reads the previous step's Y and Z without gradient
        self.detaches_steps = no_grad_cycles and outer > 1
        self.init = init
        for name in ("y_init", "z_init"):
            if init == "learned":
                setattr(self, name, nn.Parameter(torch.zeros(d_model)))
            else:  # drawn once and saved ("random"), or zeros that need no saving
                self.register_buffer(name, torch.zeros(d_model), persistent=init == "random")

    def extra_repr(self) -> str:
        return f"outer={self.outer}, inner={self.inner}, init={self.init}, no_grad_cycles={self.no_grad_cycles}"

    def start(self, topology: Topology, h_emb: torch.Tensor, h_pre: torch.Tensor) -> LoopState:
        y = self.y_init.to(h_pre.dtype).expand_as(h_pre)
        z = self.z_init.to(h_pre.dtype).expand_as(h_pre)
        return LoopState(h=y, carrier={"x": h_pre, "z": z})

    def step(self, topology: Topology, state: LoopState, core: Core, t: int) -> LoopState:
        x, y, z = state.carrier["x"], state.h, state.carrier["z"]
        for p in self.schedule:
            with contextlib.nullcontext() if p.grad else torch.no_grad():
                if p.reads == "reason":
                    z = core(x + y + z, p.index)  # Z ← f(X + Y + Z)
                else:
                    y = core(y + z, p.index)  # Y ← f(Y + Z)
        return LoopState(h=y, carrier={"x": x, "z": z}, record=state.record)

    def finish(self, topology: Topology, state: LoopState) -> torch.Tensor:
        return state.h

    def reset_parameters(self, init_std: float) -> None:
        if self.init != "zeros":
            nn.init.normal_(self.y_init, std=init_std)
            nn.init.normal_(self.z_init, std=init_std)

    def start_calls(self, topology: Topology, call: Call) -> list[Step]:
        """:meth:`start` calls no module (the topology is never called)."""
        return []

    def step_calls(self, topology: Topology, t: int, call: Call, core: CoreCalls) -> list[Step]:
        """The calls of :meth:`step`: per pass of ``schedule``, its input's stream sum and the
        core pass, without gradient where the pass runs under ``torch.no_grad``."""
        steps: list[Step] = []
        for p in self.schedule:
            slot = t * self.passes + p.index
            reads = Step("streams", f"streams.{slot}", self, dataclasses.replace(call, phase=p.reads))
            steps += in_pass([reads, *core(p.index)], slot=slot, grad=p.grad)
        return steps

    def flop_cost(self, call: Call) -> Cost:
        """One pass's input: X + Y + Z (two adds per element) for a reasoning pass
        (``phase="reason"``), Y + Z (one) for the solution pass (``phase="solve"``)."""
        adds = 2 if call.phase == "reason" else 1
        return Cost(state=adds * call.rows * self.y_init.shape[0])
