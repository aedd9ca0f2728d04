"""Zero-shot adaptive exit: a position stops looping once its output distribution has
converged (Geiping et al. 2025, "Scaling up Test-Time Compute with Latent Reasoning: A
Recurrent Depth Approach", arXiv 2502.05171, §6 "zero-shot adaptive compute at test time";
the reference code's ``generate_with_adaptive_compute``).

The rule has no parameters, so it can be set on any trained fixed-depth loop at load time
(:func:`looplm.eval.adaptive_exit.with_zero_shot_exit`): halted positions are frozen like
ACT's, so the loop stops once every position has exited and decoding catches cached
positions up (``LoopLM._catch_up``) exactly as for ACT; decode == full forward holds
because the decision of a position reads nothing but its own state."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from looplm.accounting.cost import Call, Step
from looplm.halting.base import Halting, HaltState, Readout


def kl_to_previous(log_p: torch.Tensor, log_p_prev: torch.Tensor) -> torch.Tensor:
    """KL(p_{t-1} ‖ p_t) = Σ_v p_{t-1}(v) (log p_{t-1}(v) − log p_t(v)) over the last dim:
    Huginn's exit value (its code's ``F.kl_div(log p_t, log p_{t-1}, log_target=True)``)."""
    return (log_p_prev.exp() * (log_p_prev - log_p)).sum(dim=-1)


def entropy(log_p: torch.Tensor) -> torch.Tensor:
    """H(p_t) = −Σ_v p_t(v) log p_t(v) in nats, over the last dim."""
    return -(log_p.exp() * log_p).sum(dim=-1)


class ConvergenceExit(Halting):
    """A position exits after macro step t when its distribution p_t = softmax(head(norm(y_t)))
    has converged: ``criterion="kl"``: KL(p_{t-1} ‖ p_t) < ``threshold`` (Huginn's criterion;
    never at t = 0, which has no predecessor; Huginn's default threshold 5e-4);
    ``criterion="entropy"``: H(p_t) < ``threshold`` nats (a confident prediction; may exit at
    t = 0). Every position exits at the last step otherwise. Its readout is its state at
    the exit step (frozen from then on).

    Resolved ambiguities: Huginn's code compares p_t against p_{t-1} with the arguments of
    ``F.kl_div`` giving KL(p_{t-1} ‖ p_t); that direction is used here. Huginn reads p_t
    through its coda; here p_t is read from the loop's state by the final norm and LM head
    (the model's output distribution when the layout has no coda, the logit lens of the
    loop state when it has one): a coda attends across positions, and in one parallel
    forward the earlier positions have not finished looping, so reading p_t through it would
    make a position's exit depend on how far its neighbours had run, and decoding could not
    reproduce the full forward. The criterion is evaluated without gradient (a decision,
    not a loss)."""

    freezes = True

    def __init__(self, criterion: str, threshold: float):
        super().__init__()
        self.criterion, self.threshold = criterion, threshold

    def extra_repr(self) -> str:
        return f"criterion={self.criterion}, threshold={self.threshold}"

    def reads_logits(self, targets: bool) -> bool:
        return True

    def observe(self, state: HaltState, y: torch.Tensor, t: int, last: bool, read_logits: Readout,
                targets: Optional[torch.Tensor]) -> None:
        with torch.no_grad():
            log_p = F.log_softmax(read_logits(y).float(), dim=-1)  # log p_t: [B, T, V]
            if self.criterion == "entropy":
                value = entropy(log_p)
            else:
                previous = state.extra.get("log_p")
                value = torch.full(log_p.shape[:2], torch.inf, device=y.device) if previous is None else \
                    kl_to_previous(log_p, previous)
                state.extra["log_p"] = log_p
            stop = ~state.halted & (value < self.threshold) if not last else ~state.halted
        state.steps = state.steps + state.running.long()
        state.halted = state.halted | stop
        state.running = ~state.halted
        state.readout = y  # halted positions carry their exit state in y (frozen)
        state.record.setdefault("exit_value", []).append(value)

    def step_calls(self, t: int, call: Call, readout: Readout, targets: bool) -> list[Step]:
        """p_t's final norm and LM head on the solution, every step, without gradient (the
        criterion's log-softmax, KL or entropy are left out like activations)."""
        return [Step("final_norm", f"halting.norm.{t}", readout.norm, call, grad=False),
                Step("head", f"halting.head.{t}", readout.head, call, grad=False)]
