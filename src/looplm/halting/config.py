"""``model.halting``: one config class per halting rule, chosen by the ``kind`` key.

When each position stops iterating, and what the loop hands on (its readout).
``HaltingConfig.from_dict({"kind": "act", "epsilon": 0.05})`` returns the
``ACTHaltingConfig`` that :data:`HALTING_CONFIGS` names, so a field of another rule
(``ponder_cost`` under ``qhalt``) is refused.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional, Sequence

from looplm.config_base import KindConfig, check
from looplm.halting.act import ACTHalting
from looplm.halting.base import Halting, NoHalting
from looplm.halting.convergence import ConvergenceExit
from looplm.halting.exit_gate import ExitGateHalting
from looplm.halting.mor import MoRHalting
from looplm.halting.qhalt import QHalting


@dataclasses.dataclass(frozen=True)
class HaltingConfig(KindConfig):
    """The base of every halting rule."""

    kind: str = "none"

    FIELD = "model.halting"
    FLAT_DEFAULTS = {"epsilon": 0.01, "ponder_cost": 0.01, "loss_weight": 1.0, "full_compute": False,
                     "init_bias": None}

    #: whether a learned rule decides per position how many macro steps it runs; depth that
    #: varies by position rules out MeSH's buffer, multi-resolution and head loops.
    adaptive: ClassVar[bool] = True
    #: whether the rule reads its target straight from the loop's output (no coda after it).
    needs_no_coda: ClassVar[bool] = False
    #: the fewest loop steps the rule's training objective needs
    min_iterations: ClassVar[int] = 1
    #: whether later loop steps' attention reads the first step's keys and values (MoR's
    #: recursive KV sharing): each core block must then be the same attention at every step
    reuses_first_step_kv: ClassVar[bool] = False
    #: fields that say how the rule trains or reads out, not what its weights are:
    #: ``train.init_from`` takes weights saved under other values (Ouro's Stage II from Stage I)
    WEIGHT_FREE_FIELDS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def kinds(cls) -> dict[str, type[KindConfig]]:
        return HALTING_CONFIGS

    @property
    def full_compute(self) -> bool:
        """Whether every position runs every step although a rule could stop it (false
        without a halting head: there is nothing to force)."""
        return False

    @property
    def init_bias(self) -> Optional[float]:
        """The halting head's starting bias (None without a head)."""
        return None

    @property
    def label(self) -> str:
        """The rule as error messages name it (``model.halting.kind=act``)."""
        return f"model.halting.kind={self.kind}"

    @property
    def exit_at_step(self) -> Optional[int]:
        """The loop step every position reads out at, whatever the rule says (None: the rule chooses)."""
        return None

    def build(self, d_model: int) -> Halting:
        raise NotImplementedError(f"{type(self).__name__} builds no halting rule")

    def check_loop(self, iterations: int, layout: str, mixers: Sequence[str] = ()) -> None:
        """Refuse a loop of ``iterations`` macro steps (layout ``layout``, blocks of the mixer
        kinds ``mixers``) the rule cannot serve; the model config asks."""

    def parameter_count(self, d_model: int) -> int:
        """Parameters the rule adds, from the config alone (the analytic counter)."""
        return 0


@dataclasses.dataclass(frozen=True)
class NoHaltingConfig(HaltingConfig):
    """Every position runs every macro step; the readout is the last state."""

    kind: str = "none"
    adaptive = False

    def build(self, d_model: int) -> Halting:
        return NoHalting()


@dataclasses.dataclass(frozen=True)
class HaltingHeadConfig(HaltingConfig):
    """What the rules with a learned halting head share.

    ``init_bias``: the head's starting bias; null is each rule's source default
    (``default_bias``). ``full_compute``: no position ever stops (every forward runs all C
    block passes) and the ponder cost is dropped: the compute-matched regime of
    autoregressive-trm.txt App. B.1. ACT still reads out its weighted sum; Q-halt reads
    out the final solution. Without it, halted positions are frozen (later passes leave
    them unchanged, as in UT's ACT), and a forward without a cache stops once every
    position has halted.
    """

    full_compute: bool = False
    init_bias: Optional[float] = None

    default_bias: ClassVar[float] = 0.0

    @property
    def bias(self) -> float:
        """The starting bias the head is built with."""
        return self.default_bias if self.init_bias is None else self.init_bias

    def parameter_count(self, d_model: int) -> int:
        return d_model + 1  # the halting head: d -> 1 with bias (ACT's unit, Q-halt's q)


@dataclasses.dataclass(frozen=True)
class ACTHaltingConfig(HaltingHeadConfig):
    """Graves' adaptive computation time (LT2 App. "Adaptive Computation Time", Eqs.
    halting-prob / halting-rule): p = σ(wᵀh + b) per position and macro step; a position
    halts at the first step where Σp ≥ 1 − ``epsilon`` (or at the last); the readout is
    Σ_τ w_τ h^(τ) with w_τ = p_τ before halting and the remainder R = 1 − Σ_{τ<N} p_τ at N;
    the ponder cost ``ponder_cost``·(N + R), averaged over real positions, joins the loss.
    Default bias 1.0 (UT's, p ≈ 0.73, so the readout starts on the first two iterates); a
    negative one (e.g. −3) starts the readout spread over all steps.
    """

    kind: str = "act"
    epsilon: float = 0.01
    ponder_cost: float = 0.01

    default_bias = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0.0 < self.epsilon < 1.0, "model.halting.epsilon", self.epsilon, "a number in (0, 1)")
        check(self.ponder_cost >= 0.0, "model.halting.ponder_cost", self.ponder_cost, "a number >= 0")

    def build(self, d_model: int) -> Halting:
        return ACTHalting(d_model, self.epsilon, self.ponder_cost, self.full_compute, self.bias)


@dataclasses.dataclass(frozen=True)
class QHaltingConfig(HaltingHeadConfig):
    """TRM's binary halt head q = wᵀY + b on the solution; a position halts where σ(q) >
    0.5 and reads out its terminal solution. The head learns by binary cross-entropy
    (weight ``loss_weight``) against whether the prediction read from the current solution
    is correct (TRM's Q-halt target), at every macro step, on positions with targets.
    Default bias −5.0 (TRM's, "do not halt").
    """

    kind: str = "qhalt"
    loss_weight: float = 1.0

    default_bias = -5.0
    needs_no_coda = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.loss_weight >= 0.0, "model.halting.loss_weight", self.loss_weight, "a number >= 0")

    def build(self, d_model: int) -> Halting:
        return QHalting(d_model, self.loss_weight, self.full_compute, self.bias)


@dataclasses.dataclass(frozen=True)
class ExitGateHaltingConfig(HaltingConfig):
    """Ouro's per-step exit gate (modeling_ouro.py; Zhu et al. 2025, "Scaling Latent
    Reasoning via Looped Language Models", §3.2-3.3): λ_t = σ(wᵀ norm(h_t) + b), exit
    distribution p(t) = λ_t S_{t-1}, S_t = ∏_{j≤t}(1 − λ_j) (the last step takes the rest).

    Readout (inference): ``exit_at_step`` (Ouro's ``early_exit_step``, 0-based) reads every
    position out at that step whatever the gate says; otherwise each position reads out the
    first step whose CDF reaches ``threshold`` (Ouro's ``early_exit_threshold``, default
    1.0; null: always the last step, the gate only recorded). Every position runs every
    step; only the readout is chosen.

    Training (``objective``): ``readout`` minimises the LM loss of the selected readout (the
    gate gets no gradient); ``expected`` is Ouro's Stage I objective, per position
    Σ_t p(t|x) L^(t) − β H(p(·|x)) with L^(t) the LM loss of head(norm(h_t)) and
    β = ``entropy_weight``, in place of the readout's loss. It reads every step's logits
    straight from the loop's state, so it needs a layout without a coda.

    Sources for the formula (the paper's text was not at hand): public summaries of the
    paper agree on the exit distribution above (the last step taking S_{T-1}'s mass) and on
    L = Σ_t p(t|x) L^(t) − β H(p(·|x)) with H = −Σ_t p log p, the entropy of the exit
    distribution (a KL to a uniform prior up to a constant). Default β = 0.1, the Stage I
    value as far as is known; the summaries found say only that β was lowered for
    stability during pre-training (one re-implementation uses 0.05), so set it explicitly
    to reproduce a given recipe.

    ``improvement`` is Ouro's Stage II (§3.4): the LM frozen, the gate alone trained by a
    BCE of its continuation probability 1 − λ_t against w = σ(k (I − γ)), I the loss
    improvement the next step brings, k = ``improvement_slope`` (50), γ =
    ``improvement_threshold`` (0.005) (:class:`~looplm.halting.exit_gate.ExitGateHalting`
    resolves the indexing); it needs at least two loop steps. Start it from a Stage I run
    (``train.init_from``)."""

    kind: str = "exit_gate"
    threshold: Optional[float] = 1.0
    exit_at_step: Optional[int] = None
    objective: str = "readout"
    entropy_weight: float = 0.1
    improvement_slope: float = 50.0
    improvement_threshold: float = 0.005

    OBJECTIVES: ClassVar[tuple[str, ...]] = ("readout", "expected", "improvement")
    WEIGHT_FREE_FIELDS = ("threshold", "exit_at_step", "objective", "entropy_weight", "improvement_slope",
                          "improvement_threshold")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.threshold is None or 0.0 < self.threshold <= 1.0, "model.halting.threshold", self.threshold,
              "null (read out the last step) or a number in (0, 1]")
        check(self.exit_at_step is None or self.exit_at_step >= 0, "model.halting.exit_at_step", self.exit_at_step,
              "null (the threshold rule chooses) or a 0-based loop step >= 0")
        check(self.objective in self.OBJECTIVES, "model.halting.objective", self.objective,
              f"one of {', '.join(self.OBJECTIVES)}")
        check(self.entropy_weight >= 0.0, "model.halting.entropy_weight", self.entropy_weight, "a number >= 0")
        check(self.improvement_slope > 0.0, "model.halting.improvement_slope", self.improvement_slope, "a number > 0")
        check(self.improvement_threshold >= 0.0, "model.halting.improvement_threshold", self.improvement_threshold,
              "a number >= 0 (nats)")

    @property
    def label(self) -> str:
        return f"model.halting.kind={self.kind} objective={self.objective}"

    @property
    def needs_no_coda(self) -> bool:  # type: ignore[override]
        """The expected and improvement objectives read every step's logits straight from the loop."""
        return self.objective != "readout"

    @property
    def min_iterations(self) -> int:  # type: ignore[override]
        """The improvement objective labels a step by the next one's loss: two steps at least."""
        return 2 if self.objective == "improvement" else 1

    def build(self, d_model: int) -> Halting:
        return ExitGateHalting(d_model, self.threshold, self.exit_at_step, self.objective, self.entropy_weight,
                               self.improvement_slope, self.improvement_threshold)

    def parameter_count(self, d_model: int) -> int:
        return d_model + 1  # the gate: d -> 1 with bias


@dataclasses.dataclass(frozen=True)
class ConvergenceExitConfig(HaltingConfig):
    """Zero-shot adaptive exit (Huginn, Geiping et al. 2025 §6; :class:`ConvergenceExit`): a
    position stops looping once ``criterion`` says its output distribution has converged,
    ``kl``: KL(p_{t-1} ‖ p_t) < ``threshold`` (Huginn's default 5e-4), ``entropy``: H(p_t) <
    ``threshold`` nats. No parameters: set it on a trained fixed-depth loop at load time
    (``looplm eval --exit kl:5e-4``) to trade loss for block passes."""

    kind: str = "convergence"
    criterion: str = "kl"
    threshold: float = 5e-4

    CRITERIA: ClassVar[tuple[str, ...]] = ("kl", "entropy")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.criterion in self.CRITERIA, "model.halting.criterion", self.criterion,
              f"one of {', '.join(self.CRITERIA)}")
        check(isinstance(self.threshold, (int, float)) and self.threshold > 0, "model.halting.threshold",
              self.threshold, "a number > 0 (nats)")

    @property
    def label(self) -> str:
        return f"model.halting.kind={self.kind} criterion={self.criterion} threshold={self.threshold:g}"

    def build(self, d_model: int) -> Halting:
        return ConvergenceExit(self.criterion, float(self.threshold))


@dataclasses.dataclass(frozen=True)
class MoRHaltingConfig(HaltingConfig):
    """Mixture-of-Recursions (Bae et al. 2025, §2.2.1; :mod:`looplm.halting.mor` says how
    the paper maps onto the loop and how its ambiguities are resolved): a router gives each
    position its recursion depth, 1 to ``depths`` (the loop's iterations); every position
    takes step 0.

    ``routing``: ``expert_choice`` (a router per later step; step r keeps k = ⌊β_r·T⌋
    positions, ``capacity`` β_1..β_{N−1}, default the hierarchical (N − r)/N) or
    ``token_choice`` (one router picks the depth after step 0; Switch balancing loss
    weighted ``balance_weight``). ``selection`` (expert choice): ``threshold`` (σ(s) > 0.5 in
    training and inference, causal; the auxiliary BCE toward the top-k, weight
    ``aux_loss_weight``, teaches the router the capacity) or ``top_k`` (the paper's training
    form: top-k over the sequence in training, not causal; the threshold at inference).
    ``kv``: ``all`` (a step's attention sees every position, those that left through their
    frozen states), ``recursion`` (only the positions taking the step, the paper's
    recursion-wise KV caching; softmax-attention mixers, any cache) or
    ``shared`` (the paper's recursive KV sharing, §2.2.2: every later step attends over the
    keys and values the first step computed, projecting queries only; softmax-attention
    mixers and one shared core stack run the same way at every step, any cache).
    ``auxiliary`` (expert choice): ``loss`` (the router's own logits take the BCE and the
    threshold) or ``router`` (a second router per step, on the detached state, does: the
    paper's auxiliary router). ``alpha`` scales the gate g; ``init_bias`` starts the routers
    at full depth. ``skip`` (under ``kv: recursion`` or ``shared``): a forward without a
    decoding cache (under ``shared`` also a prefill into an empty growing cache) runs each
    later step's blocks on the positions taking it alone, gathered
    (the paper's compute saving; one host sync per step for the gathered length, so a
    compiled forward takes the frozen path; a MoE FFN's balance and z-losses count the rows
    each step runs, not every position); false runs every position, those that left frozen. Under
    ``kv: all`` every position runs every step (later steps read all positions' keys)."""

    kind: str = "mor"
    depths: int = 3
    routing: str = "expert_choice"
    selection: str = "threshold"
    capacity: Optional[tuple[float, ...]] = None
    kv: str = "all"
    auxiliary: str = "loss"
    skip: bool = True
    alpha: float = 1.0
    aux_loss_weight: float = 0.01
    balance_weight: float = 0.01
    init_bias: float = 1.0  # type: ignore[assignment]

    ROUTINGS: ClassVar[tuple[str, ...]] = ("expert_choice", "token_choice")
    SELECTIONS: ClassVar[tuple[str, ...]] = ("threshold", "top_k")
    KV: ClassVar[tuple[str, ...]] = ("all", "recursion", "shared")
    AUXILIARIES: ClassVar[tuple[str, ...]] = ("loss", "router")
    #: the mixers that can hide a position's keys from a step (``kv: recursion``) or attend
    #: over another step's keys and values (``kv: shared``): softmax attention
    KEY_MASKING_MIXERS: ClassVar[tuple[str, ...]] = ("attention", "sliding_window")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.capacity is not None and not isinstance(self.capacity, tuple):
            object.__setattr__(self, "capacity", tuple(self.capacity))
        check(isinstance(self.depths, int) and self.depths >= 2, "model.halting.depths", self.depths,
              "an integer >= 2 (the loop's iterations)")
        check(self.routing in self.ROUTINGS, "model.halting.routing", self.routing, f"one of {', '.join(self.ROUTINGS)}")
        check(self.selection in self.SELECTIONS, "model.halting.selection", self.selection,
              f"one of {', '.join(self.SELECTIONS)}")
        check(self.routing == "expert_choice" or self.selection == "threshold", "model.halting.selection",
              self.selection, "threshold with routing=token_choice (top-k selection is expert choice's)")
        check(self.capacity is None or (self.routing == "expert_choice" and len(self.capacity) == self.depths - 1
                                        and all(0.0 < b <= 1.0 for b in self.capacity)),
              "model.halting.capacity", None if self.capacity is None else list(self.capacity),
              f"null or, with routing=expert_choice, {self.depths - 1} fractions in (0, 1], one per step after the first")
        check(self.kv in self.KV, "model.halting.kv", self.kv, f"one of {', '.join(self.KV)}")
        check(self.auxiliary in self.AUXILIARIES, "model.halting.auxiliary", self.auxiliary,
              f"one of {', '.join(self.AUXILIARIES)}")
        check(self.auxiliary == "loss" or (self.routing == "expert_choice" and self.aux_loss_weight > 0),
              "model.halting.auxiliary", self.auxiliary,
              "loss, unless routing=expert_choice and aux_loss_weight > 0 (the BCE is what trains the auxiliary router)")
        check(isinstance(self.skip, bool), "model.halting.skip", self.skip, "true or false")
        check(self.alpha > 0.0, "model.halting.alpha", self.alpha, "a number > 0")
        check(self.aux_loss_weight >= 0.0, "model.halting.aux_loss_weight", self.aux_loss_weight, "a number >= 0")
        check(self.balance_weight >= 0.0, "model.halting.balance_weight", self.balance_weight, "a number >= 0")

    @property
    def capacities(self) -> tuple[float, ...]:
        """β_r for r = 0..N−1: 1 at step 0, then ``capacity``, else the hierarchical (N − r)/N."""
        later = self.capacity or tuple((self.depths - r) / self.depths for r in range(1, self.depths))
        return (1.0, *later)

    @property
    def causal(self) -> bool:
        """Whether the training forward is strictly causal (false for top-k selection, whose
        choice of a position depends on later positions' scores; inference is causal either way)."""
        return self.selection != "top_k"

    @property
    def label(self) -> str:
        return f"model.halting.kind={self.kind} routing={self.routing} selection={self.selection} kv={self.kv}"

    def check_loop(self, iterations: int, layout: str, mixers: Sequence[str] = ()) -> None:
        check(self.depths == iterations, "model.halting.depths", self.depths,
              f"{iterations}, the iterations of layout {layout!r} (one recursion per loop step)")
        other = sorted(set(mixers) - set(self.KEY_MASKING_MIXERS))
        if self.kv == "recursion":
            check(not other, "model.halting.kv", self.kv,
                  f"all with mixer kinds {', '.join(other)}: recursion-wise KV hides keys per step, which "
                  f"{', '.join(self.KEY_MASKING_MIXERS)} can")
        if self.kv == "shared":
            check(not other, "model.halting.kv", self.kv,
                  f"all or recursion with mixer kinds {', '.join(other)}: recursive KV sharing reuses the first "
                  f"step's keys and values, which {', '.join(self.KEY_MASKING_MIXERS)} have (a recurrent or "
                  "sparse mixer's state has none to share)")

    @property
    def reuses_first_step_kv(self) -> bool:  # type: ignore[override]
        return self.kv == "shared"

    def build(self, d_model: int) -> Halting:
        return MoRHalting(d_model, self.depths, self.routing, self.selection, self.capacities, self.alpha,
                          self.aux_loss_weight, self.balance_weight, self.init_bias, self.kv, self.auxiliary,
                          self.skip)

    def parameter_count(self, d_model: int) -> int:
        if self.routing == "token_choice":
            return self.depths * (d_model + 1)  # one router d -> N with biases
        per_step = 2 if self.auxiliary == "router" else 1  # the router, and the auxiliary router
        return per_step * (self.depths - 1) * (d_model + 1)


#: The halting rules: ``kind`` -> config class. One line per kind.
HALTING_CONFIGS: dict[str, type[KindConfig]] = {
    "none": NoHaltingConfig,
    "act": ACTHaltingConfig,
    "qhalt": QHaltingConfig,
    "exit_gate": ExitGateHaltingConfig,
    "convergence": ConvergenceExitConfig,
    "mor": MoRHaltingConfig,
}
