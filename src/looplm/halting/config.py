"""When each position stops iterating, and what the loop hands on (its readout)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from looplm.config_base import Config, check


@dataclasses.dataclass(frozen=True)
class HaltingConfig(Config):
    """``none``: every position runs every macro step; the readout is the last state.

    ``act``: Graves' adaptive computation time (LT2 App. "Adaptive Computation Time", Eqs.
    halting-prob / halting-rule): p = σ(wᵀh + b) per position and macro step; a position
    halts at the first step where Σp ≥ 1 − ``epsilon`` (or at the last); the readout is
    Σ_τ w_τ h^(τ) with w_τ = p_τ before halting and the remainder R = 1 − Σ_{τ<N} p_τ at N;
    the ponder cost ``ponder_cost``·(N + R), averaged over real positions, joins the loss.

    ``qhalt``: TRM's binary halt head q = wᵀY + b on the solution; a position halts where
    σ(q) > 0.5 and reads out its terminal solution. The head learns by binary cross-entropy
    (weight ``loss_weight``) against whether the prediction read from the current solution
    is correct (TRM's Q-halt target), at every macro step, on positions with targets.

    ``init_bias``: the halting unit's (or Q head's) starting bias; null is each rule's
    source default: ACT 1.0 (UT's, p ≈ 0.73, so the readout starts on the first two
    iterates), Q-halt −5.0 (TRM's, "do not halt"). A negative ACT bias (e.g. −3) starts the
    readout spread over all steps.

    ``full_compute``: no position ever stops (every forward runs all C block passes) and
    the ponder cost is dropped: the compute-matched regime of autoregressive-trm.txt App.
    B.1. ACT still reads out its weighted sum; Q-halt reads out the final solution.
    Without it, halted positions are frozen (later passes leave them unchanged, as in UT's
    ACT), and a forward without a cache stops once every position has halted.
    """

    kind: Literal["none", "act", "qhalt"] = "none"
    epsilon: float = 0.01
    ponder_cost: float = 0.01
    loss_weight: float = 1.0
    full_compute: bool = False
    init_bias: Optional[float] = None

    def __post_init__(self) -> None:
        check(0.0 < self.epsilon < 1.0, "model.halting.epsilon", self.epsilon, "a number in (0, 1)")
        check(self.ponder_cost >= 0.0, "model.halting.ponder_cost", self.ponder_cost, "a number >= 0")
        check(self.loss_weight >= 0.0, "model.halting.loss_weight", self.loss_weight, "a number >= 0")
        check(self.kind != "none" or not self.full_compute, "model.halting.full_compute", self.full_compute,
              "false for kind=none (there is nothing to force)")
        check(self.kind != "none" or self.init_bias is None, "model.halting.init_bias", self.init_bias,
              "null for kind=none (there is no halting head)")
