"""TRM-style binary halting on the solution stream with terminal readout
(autoregressive-trm.txt §2.3, App. B.1; Jolicoeur-Martineau 2025)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost, Step, module_cost
from looplm.halting.base import Halting, HaltState, ReadLogits, Readout
from looplm.targets import IGNORE_INDEX


class QHalting(Halting):
    """q_t^(τ) = wᵀY_t^(τ) + b; a position halts at the first macro step where σ(q) > 0.5
    (or the last) and reads out its terminal solution (frozen from then on). Training
    signal: BCE(q, 1[argmax logits(Y^(τ)) = target]) at every step the position runs, on
    positions with a target, averaged and weighted by ``loss_weight``. The head starts at
    w = 0, b = ``init_bias`` (default −5, TRM's init: "do not halt"). With ``full_compute`` every position runs
    every step and the readout is the final solution; the head still learns."""


    def __init__(self, d_model: int, loss_weight: float, full_compute: bool, init_bias: float = -5.0):
        super().__init__()
        self.head = nn.Linear(d_model, 1)
        self.init_bias = init_bias
        self.loss_weight, self.full_compute = loss_weight, full_compute
        self.freezes = not full_compute
        # a frozen position reads its state of an earlier step; the BCE reads every step's q
        self.reads_every_step = self.freezes or loss_weight > 0

    def extra_repr(self) -> str:
        return f"loss_weight={self.loss_weight}, full_compute={self.full_compute}"

    def reads_logits(self, targets: bool) -> bool:
        """The BCE target 1[argmax logits(Y) = target] needs the logits, given targets."""
        return targets and self.loss_weight > 0

    def observe(self, state: HaltState, y: torch.Tensor, t: int, last: bool, read_logits: ReadLogits,
                targets: Optional[torch.Tensor]) -> None:
        q = self.head(y).squeeze(-1).float()  # [B, T]
        running = state.running
        if self.reads_logits(targets is not None):
            with torch.no_grad():
                correct = (read_logits(y).argmax(dim=-1) == targets).float()
            mask = running & (targets != IGNORE_INDEX)
            bce = F.binary_cross_entropy_with_logits(q, correct, reduction="none")
            state.extra["bce_sum"] = state.extra.get("bce_sum", 0.0) + (bce * mask).sum()
            state.extra["bce_count"] = state.extra.get("bce_count", 0.0) + mask.sum()
        stop = ~state.halted if last else ~state.halted & (q > 0.0)  # σ(q) > 0.5
        state.steps = state.steps + running.long()
        state.halted = state.halted | stop
        state.record.setdefault("q_halt", []).append(torch.sigmoid(q).detach())
        if self.freezes:
            state.running = ~state.halted
        state.readout = y  # frozen positions carry their terminal solution in y

    def finish(self, state: HaltState) -> torch.Tensor:
        if "bce_sum" in state.extra:
            count = state.extra["bce_count"]
            state.losses["q_halt"] = self.loss_weight * state.extra["bce_sum"] / torch.as_tensor(count).clamp_min(1.0)
        return state.readout

    def reset_parameters(self, init_std: float) -> None:
        nn.init.zeros_(self.head.weight)
        nn.init.constant_(self.head.bias, self.init_bias)

    def step_calls(self, t: int, call: Call, readout: Readout, targets: bool) -> list[Step]:
        """The q head (with a backward only where the BCE reads q: ``loss_weight`` > 0; else q
        only decides halting, by a comparison); given targets, then the BCE target's readout
        head(norm(Y)) under ``torch.no_grad``."""
        steps = [Step("halting", f"halting.{t}", self, call, grad=self.loss_weight > 0)]
        if self.reads_logits(targets):
            steps += [Step("final_norm", f"halting.target.norm.{t}", readout.norm, call, grad=False, targets_only=True),
                      Step("head", f"halting.target.head.{t}", readout.head, call, grad=False, targets_only=True)]
        return steps

    def flop_cost(self, call: Call) -> Cost:
        """One macro step: the q head d -> 1 (with its bias) on every position. Its training
        target (final norm + LM head on the solution) is separate, targets-only steps."""
        return module_cost(self.head, call)
