"""A per-step exit gate with a fixed exit step or a cumulative-probability threshold, and
Ouro's two training objectives: Stage I's entropy-regularised expected loss and Stage II's
gate trained alone on each step's loss improvement (Zhu et al. 2025, "Scaling Latent
Reasoning via Looped Language Models", §3.2-3.4; modeling_ouro.py,
``OuroModel.early_exit_gate`` and ``OuroForCausalLM``'s ``exit_at_step`` / ``exit_threshold``
rules).

Every position runs every step (the later steps of an exited position still feed the
attention of later positions, as in Ouro); the rule only chooses, per position, which
step's state is read out, and, under the expected objective, trains every step's readout."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost, Step, module_cost
from looplm.halting.base import Halting, HaltState, Readout, masked_mean
from looplm.targets import IGNORE_INDEX


class ExitGateHalting(Halting):
    """λ_t = σ(wᵀ norm(y_t) + b) on the final-normed state of step t; the exit distribution
    p(t) = λ_t S_{t-1} with S_t = ∏_{j≤t}(1 − λ_j), S_{-1} = 1, for t < T − 1, and p(T − 1)
    = S_{T-2}, the remaining mass (so Σ p = 1).

    Readout: with ``exit_at_step`` k < T every position reads out y_k (Ouro's ``exit_at_step``
    wins over the threshold; a k the forward does not reach, as with ``iterations`` < k + 1
    at test time, is ignored, as Ouro ignores it); otherwise a position exits at the first
    step whose CDF Σ_{s≤t} p(s) reaches ``threshold`` (else the last) and reads out y there.
    ``threshold`` 1.0 reads out the last step unless the gate saturates (the CDF reaching
    1.0 in floating point: Ouro exits there too); None always reads out the last step.

    Training, in a forward given targets: ``objective="readout"`` leaves the LM loss of the
    readout as the task loss (the gate gets no gradient). ``objective="expected"`` is Ouro's
    Stage I loss (§3.3, Eq. 3), per position with a target,
        L = Σ_t p(t|x) L^(t) − β H(p(·|x)),   H(p) = −Σ_t p(t) log p(t),
    L^(t) the cross-entropy of head(norm(y_t)), β = ``entropy_weight`` (the entropy is
    that of the exit distribution, not of λ; equivalently a KL to the uniform prior up to a
    constant). It joins the loss as ``exit_expected_lm`` (Σ_t p L^(t), averaged over
    positions with a target) and ``exit_entropy`` (−β H, likewise) in place of the
    readout's LM loss (:attr:`trains_readout` is false); the model still reports the
    readout's loss as ``lm_loss``. The norm(y_t) the gate reads is the one the step's head
    reads (one norm per step).

    ``objective="improvement"`` is Ouro's Stage II (§3.4, "focused adaptive gate training"):
    the LM is frozen (:attr:`trains_lm` is false: the model trains the gate alone) and the
    gate learns, per position with a target, from how much the next step improves that
    position's loss,
        I^(t) = max(0, L^(t) − L^(t+1)),   w^(t) = σ(k (I^(t) − γ)),
        L_adaptive = mean_{t < T−1, positions} BCE(1 − λ_t, w^(t))
                   = −mean [w^(t) log(1 − λ_t) + (1 − w^(t)) log λ_t],
    with L^(t) the cross-entropy of head(norm(y_t)) under stop-gradient, k =
    ``improvement_slope`` and γ = ``improvement_threshold`` (continue where the next step
    still lowers the loss by more than γ). It joins the loss as ``exit_improvement``, alone.
    Resolved: the summaries of the paper available (its text was not at hand; they agree on
    k = 50, γ = 0.005 and the BCE on the continuation probability 1 − λ) write the
    improvement as I^(t) = L^(t−1) − L^(t) paired with λ_t; here λ_t decides whether to
    stop *after* step t (the exit distribution above), so its label is the improvement the
    following step brings, and the last step, whose λ the exit distribution never uses, gets
    no label.

    Records the exit probabilities p(t) (``exit_probability``) and each position's exit
    step (``exit_step``)."""

    def __init__(self, d_model: int, threshold: Optional[float], exit_at_step: Optional[int] = None,
                 objective: str = "readout", entropy_weight: float = 0.1, improvement_slope: float = 50.0,
                 improvement_threshold: float = 0.005):
        super().__init__()
        self.gate = nn.Linear(d_model, 1)
        self.threshold, self.exit_at_step = threshold, exit_at_step
        self.objective, self.entropy_weight = objective, entropy_weight
        self.improvement_slope, self.improvement_threshold = improvement_slope, improvement_threshold
        self.trains_readout = objective == "readout"
        self.trains_lm = objective != "improvement"

    def extra_repr(self) -> str:
        return (f"threshold={self.threshold}, exit_at_step={self.exit_at_step}, objective={self.objective}, "
                f"entropy_weight={self.entropy_weight}")

    def reads_logits(self, targets: bool) -> bool:
        """The expected and improvement objectives read every step's logits, given targets
        (with gradient under the expected objective; the improvement objective's L^(t) are
        labels, under stop-gradient)."""
        return targets and self.objective != "readout"

    def begin(self, h: torch.Tensor, valid: torch.Tensor) -> HaltState:
        state = super().begin(h, valid)
        ones = torch.ones(h.shape[:2], device=h.device)
        state.extra = {"survive": ones, "cdf": torch.zeros_like(ones),
                       "exit_step": torch.full(h.shape[:2], -1, dtype=torch.long, device=h.device)}
        return state

    def observe(self, state: HaltState, y: torch.Tensor, t: int, last: bool, read_logits: Readout,
                targets: Optional[torch.Tensor]) -> None:
        survive = state.extra["survive"]
        normed = read_logits.norm(y)
        gate_logit = self.gate(normed).squeeze(-1).float()  # z_t, λ_t = σ(z_t): [B, T]
        lam = torch.sigmoid(gate_logit)
        p = survive if last else lam * survive  # p(t) = λ_t S_{t-1}; the last step takes S_{T-2}
        cdf = state.extra["cdf"] + p
        reached = cdf >= self.threshold if self.threshold is not None else torch.zeros_like(state.halted)
        exits = ~state.halted & (reached | last)
        state.readout = y if state.readout is None else torch.where(exits.unsqueeze(-1), y, state.readout)
        state.extra.update(survive=survive * (1.0 - lam), cdf=cdf,
                           exit_step=torch.where(exits, t, state.extra["exit_step"]))
        if t == self.exit_at_step:
            state.extra["fixed"] = y
        if self.objective == "improvement" and targets is not None:
            self._improvement(state, read_logits.head, normed, gate_logit, targets)
        elif self.reads_logits(targets is not None):
            logits = read_logits.head(normed).float()  # L^(t): [B, T] per-position cross-entropy
            loss_t = step_loss(logits, targets)
            neg_entropy = p * torch.log(p.clamp_min(1e-12))  # p log p (0 where p = 0, finite gradient)
            state.extra["expected"] = state.extra.get("expected", 0.0) + p * loss_t  # Σ_t p(t) L^(t)
            state.extra["neg_entropy"] = state.extra.get("neg_entropy", 0.0) + neg_entropy  # −H(p)
            state.extra["has_target"] = targets != IGNORE_INDEX
        state.halted = state.halted | exits
        state.steps = state.steps + state.running.long()  # every position runs every step
        state.record.setdefault("exit_probability", []).append(p.detach())

    def _improvement(self, state: HaltState, head, normed: torch.Tensor, gate_logit: torch.Tensor,
                     targets: torch.Tensor) -> None:
        """Stage II: L^(t) under stop-gradient; the BCE of the previous step's gate against
        the improvement this step brought, w^(t−1) = σ(k (max(0, L^(t−1) − L^(t)) − γ))."""
        with torch.no_grad():
            loss_t = step_loss(head(normed).float(), targets)  # L^(t): [B, T]
        if "previous_loss" in state.extra:
            improvement = (state.extra["previous_loss"] - loss_t).clamp_min(0.0)  # I = max(0, L^(t−1) − L^(t))
            label = torch.sigmoid(self.improvement_slope * (improvement - self.improvement_threshold))  # w
            # BCE(1 − λ, w) with 1 − λ = σ(−z): −[w log(1 − λ) + (1 − w) log λ]
            bce = F.binary_cross_entropy_with_logits(-state.extra["previous_gate_logit"], label, reduction="none")
            mask = targets != IGNORE_INDEX
            state.extra["bce_sum"] = state.extra.get("bce_sum", 0.0) + (bce * mask).sum()
            state.extra["bce_count"] = state.extra.get("bce_count", 0) + mask.sum()
        state.extra.update(previous_loss=loss_t, previous_gate_logit=gate_logit)

    def finish(self, state: HaltState) -> torch.Tensor:
        if "bce_sum" in state.extra:
            state.losses["exit_improvement"] = state.extra["bce_sum"] / state.extra["bce_count"].clamp_min(1)
        if "expected" in state.extra:
            mask = state.extra["has_target"]
            state.losses["exit_expected_lm"] = masked_mean(state.extra["expected"], mask)
            state.losses["exit_entropy"] = self.entropy_weight * masked_mean(state.extra["neg_entropy"], mask)
        if "fixed" in state.extra:  # exit_at_step reached: it wins over the threshold rule
            state.extra["exit_step"] = torch.full_like(state.extra["exit_step"], self.exit_at_step)
            state.readout = state.extra["fixed"]
        state.record["exit_step"] = [state.extra["exit_step"]]
        return state.readout

    def reset_parameters(self, init_std: float) -> None:
        nn.init.normal_(self.gate.weight, std=init_std)
        nn.init.zeros_(self.gate.bias)

    def step_calls(self, t: int, call: Call, readout: Readout, targets: bool) -> list[Step]:
        """norm(Y), the gate on it; under the expected and improvement objectives, given
        targets, the LM head on the same norm(Y) (L^(t): with gradient under the expected
        objective, a stop-gradient label under the improvement objective). Under the readout
        objective λ only selects where the readout is taken (a mask), and neither the expected
        objective's p(T) nor the improvement objective's labels read the last step's λ: no
        loss reaches those gates, nor the norm that feeds them alone."""
        trained = self.objective != "readout" and not call.last
        read = trained or (self.reads_logits(targets) and self.objective == "expected")  # L^(t) reads the norm too
        steps = [Step("final_norm", f"halting.norm.{t}", readout.norm, call, grad=read),
                 Step("halting", f"halting.{t}", self, call, grad=trained)]
        if self.reads_logits(targets):
            steps.append(Step("head", f"halting.target.head.{t}", readout.head, call,
                              grad=self.objective == "expected", targets_only=True))
        return steps

    def flop_cost(self, call: Call) -> Cost:
        """One macro step: the gate d -> 1 (with its bias) on every position and the readout's
        selection of the exiting positions' states (one element each). The final norm it reads
        is a separate step."""
        return module_cost(self.gate, call) + Cost(state=call.rows * self.gate.in_features)


def step_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """L^(t): the per-position cross-entropy [B, T] of one step's logits [B, T, V] (0 where
    the target is ignored)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="none").view(targets.shape)
