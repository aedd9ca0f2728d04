"""FLOP counter over the unrolled computation, with a per-component breakdown.

The counter walks the model's execution plan (:func:`execution_plan`: embed, prelude
blocks, the topology's start, each iteration's core blocks with that iteration's mixer
view and the topology step, coda, final norm, head) and asks a *rule* for each module's
cost. Rules are registered by module type (:func:`register_flop_rule`); a module without
a rule costs the sum of its children, each applied once to every position. A rule returns
a :class:`Cost` whose terms are kept apart (MACs, score/value products, norms, biases,
residual and state elementwise ops) so that a :class:`~looplm.accounting.conventions.Convention`
only weighs them. Looped blocks are counted once per iteration (LT2's convention); a new
mechanism (resolution schedules, SGT head passes, halting) adds plan steps or a rule, not
a branch here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Optional, Union

import torch
from torch import nn

from looplm.accounting.conventions import Convention, get_convention
from looplm.model_config import ModelConfig

# ---------------------------------------------------------------------------- costs


@dataclasses.dataclass
class Cost:
    """Operation counts of one module call, per term.

    mac: multiply-accumulates of projections and other matmuls. attn_full / attn_causal:
    MACs of the score and value products over all T × S pairs / over the pairs a query
    may see. mixer_chunk / mixer_recurrent: MACs of a linear mixer's core in its chunkwise
    form / as the token recurrence. read_mac: MACs of the MeSH buffer read. norm: norm
    FLOPs. bias: bias additions. residual: the block's residual additions. state: the
    topology's elementwise ops. embed: the embedding lookup as one-hot MACs (V·d per token)."""

    mac: float = 0
    attn_full: float = 0
    attn_causal: float = 0
    mixer_chunk: float = 0
    mixer_recurrent: float = 0
    read_mac: float = 0
    norm: float = 0
    bias: float = 0
    residual: float = 0
    state: float = 0
    embed: float = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})

    def scale(self, factor: float) -> "Cost":
        return Cost(**{f.name: getattr(self, f.name) * factor for f in dataclasses.fields(self)})

    def flops(self, convention: Convention) -> float:
        c = convention
        attention = {"full": self.attn_full, "causal": self.attn_causal, "none": 0}[c.attention]
        mixer = self.mixer_chunk if c.linear_form == "chunk" else self.mixer_recurrent
        return (
            c.flops_per_mac * (self.mac + attention + mixer)
            + (c.read_flops_per_mac or c.flops_per_mac) * self.read_mac
            + (self.norm if c.norms else 0)
            + (self.bias if c.bias else 0)
            + (self.residual if c.residual else 0)
            + (self.state if c.state else 0)
            + (c.flops_per_mac * self.embed if c.embedding else 0)
        )


@dataclasses.dataclass(frozen=True)
class Call:
    """How a module is called: ``batch`` rows of ``tokens`` new positions seeing ``keys``
    positions in all (``keys == tokens`` for a full forward). ``phase``: ``start`` or
    ``step`` for topologies. ``iteration``: loop iteration (-1 outside the loop)."""


    batch: int
    tokens: int
    keys: int
    phase: str = "step"
    iteration: int = -1
    width: int = 0  # d_model, for modules without a parameter that says it

    @property
    def rows(self) -> int:
        return self.batch * self.tokens


Rule = Callable[[nn.Module, Call], Cost]
_RULES: dict[type, Rule] = {}


def register_flop_rule(*types: type) -> Callable[[Rule], Rule]:
    """Register ``rule(module, call) -> Cost`` for modules of ``types`` (and subclasses)."""

    def wrap(rule: Rule) -> Rule:
        for t in types:
            _RULES[t] = rule
        return rule

    return wrap


def module_cost(module: nn.Module, call: Call) -> Cost:
    """Cost of one call of ``module``: its registered rule (nearest in the MRO), else the
    sum of its children's costs (each child applied once to every position)."""
    for klass in type(module).__mro__:
        if klass in _RULES:
            return _RULES[klass](module, call)
    return children_cost(module, call)


def children_cost(module: nn.Module, call: Call) -> Cost:
    total = Cost()
    for child in module.children():
        total = total + module_cost(child, call)
    return total


# ------------------------------------------------------------------ generic rules


@register_flop_rule(nn.Linear)
def _linear(m: nn.Linear, call: Call) -> Cost:
    return Cost(mac=call.rows * m.in_features * m.out_features, bias=call.rows * m.out_features if m.bias is not None else 0)


@register_flop_rule(nn.Embedding)
def _embedding(m: nn.Embedding, call: Call) -> Cost:
    return Cost(embed=call.rows * m.num_embeddings * m.embedding_dim)  # a lookup; as a one-hot matmul, V·d MACs


@register_flop_rule(nn.Dropout, nn.Identity)
def _free(m: nn.Module, call: Call) -> Cost:
    return Cost()  # nothing


@register_flop_rule(nn.LayerNorm)
def _layernorm(m: nn.LayerNorm, call: Call) -> Cost:
    return Cost(norm=call.rows * m.normalized_shape[-1] * (5 if m.weight is not None else 4))  # fvcore's rule


@register_flop_rule(nn.Conv1d)
def _conv1d(m: nn.Conv1d, call: Call) -> Cost:
    """A causal (depthwise) convolution over the sequence: K·C_in/groups MACs per output."""
    per = m.kernel_size[0] * m.in_channels // m.groups
    return Cost(mac=call.rows * m.out_channels * per, bias=call.rows * m.out_channels if m.bias is not None else 0)


def causal_pairs(tokens: int, keys: int, window: Optional[int] = None) -> int:
    """(query, key) pairs of causal attention of the last ``tokens`` of ``keys`` positions,
    each seeing at most ``window`` keys (itself included)."""
    past = keys - tokens
    total = 0
    if window is None:
        # Σ_{i=past}^{keys-1} (i + 1)
        return (keys * (keys + 1) - past * (past + 1)) // 2
    for i in range(past, keys):  # closed form below for long sequences
        if i + 1 >= window:
            return total + (keys - i) * window
        total += i + 1
    return total


# ------------------------------------------------------------------ the plan


@dataclasses.dataclass(frozen=True)
class Step:
    """One module call on the unrolled path: ``component`` (embedding, prelude, core,
    coda, topology, final_norm, head, ...), ``name`` (e.g. ``core.1``), the module and how
    it is called."""

    component: str
    name: str
    module: nn.Module
    call: Call


def execution_plan(model: nn.Module, seq_len: int, batch: int = 1) -> list[Step]:
    """The module calls of one full forward of ``model`` (a LoopLM) on [batch, seq_len],
    in order, loops unrolled. A multi-resolution iteration t (``model.resolution``,
    spiralformer.txt Alg. 1) adds S↓ on the tokens of its L_t complete chunks, runs the
    core on L_t positions (:func:`~looplm.resolution.core_lengths`) and adds S↑ with the
    causal shift on all T positions; the topology step runs at full resolution. A block's
    grown loop (SGT) is read from the block by its rule (:func:`rules.block_cost`)."""
    from looplm.modules.block import Block  # noqa: F401  (rules registered below)
    from looplm.resolution.schedule import core_lengths

    cfg = model.cfg
    layout = cfg.loop
    full = Call(batch, seq_len, seq_len, width=cfg.d_model)
    plan = [Step("embedding", "embed", model.embed, full)]
    for j, block in enumerate(model.prelude):
        plan.append(Step("prelude", f"prelude.{j}", _BlockCall(block, 0), full))
    if model.topology is not None:
        resolution = getattr(model, "resolution", None)
        lengths = core_lengths(resolution.schedule, seq_len) if resolution is not None else [seq_len] * layout.iterations
        plan.append(Step("topology", "topology.start", model.topology, dataclasses.replace(full, phase="start")))
        for t in range(layout.iterations):
            n = lengths[t]  # L_t positions: T at full resolution, the complete chunks otherwise
            call = Call(batch, n, n, iteration=t, width=cfg.d_model)
            scaled = resolution is not None and not resolution.identity(t)
            if scaled:
                g = resolution.schedule[t].chunk
                down = Call(batch, n * g, n * g, phase="down", iteration=t, width=cfg.d_model)
                plan.append(Step("resolution", f"resolution.down.{t}", _ResolutionCall(resolution, t), down))
            stack = model.core[0 if cfg.share_core else t]
            for j, block in enumerate(stack):
                plan.append(Step("core", f"core.{j}", _BlockCall(block, t), call))
            if scaled:
                up = dataclasses.replace(full, phase="up", iteration=t)
                plan.append(Step("resolution", f"resolution.up.{t}", _ResolutionCall(resolution, t), up))
            plan.append(Step("topology", f"topology.step.{t}", model.topology, dataclasses.replace(full, iteration=t)))
    for j, block in enumerate(model.coda):
        plan.append(Step("coda", f"coda.{j}", _BlockCall(block, 0), full))
    plan.append(Step("final_norm", "norm", model.norm, full))
    plan.append(Step("head", "head", model.head, full))
    return plan


class _ResolutionCall(nn.Module):
    """Iteration t's S↓ (``phase="down"``: on the n·g_t tokens of its n complete chunks)
    or S↑ and the causal shift (``phase="up"``: on every position)."""

    def __init__(self, resolution: nn.Module, iteration: int):
        super().__init__()
        self.resolution, self.iteration = resolution, iteration


class _BlockCall(nn.Module):
    """A block as it runs at one iteration (its mixer view for that iteration)."""

    def __init__(self, block: nn.Module, iteration: int):
        super().__init__()
        self.block, self.iteration = block, iteration


# ------------------------------------------------------------------ the report


@dataclasses.dataclass
class FlopReport:
    """FLOPs of one forward of ``batch`` sequences of ``seq_len`` tokens under ``convention``.

    forward / training: per batch of sequences; per_token: forward / (batch·seq_len);
    components: forward FLOPs per component (embedding, prelude, core, coda, topology,
    final_norm, head); steps: forward FLOPs per plan step name, summed over iterations;
    costs: the unweighted terms per component."""

    convention: Convention
    seq_len: int
    batch: int
    forward: float
    components: dict[str, float]
    steps: dict[str, float]
    costs: dict[str, Cost]

    @property
    def training(self) -> float:
        """multiplier × forward; an embedding counted as a matmul (``convention.embedding``)
        costs 2 × its forward instead (forward and weight gradient, no input gradient)."""
        embedding = self.components.get("embedding", 0)
        return self.convention.training_multiplier * (self.forward - embedding) + 2 * embedding

    @property
    def forward_per_token(self) -> float:
        return self.forward / (self.batch * self.seq_len)

    @property
    def training_per_token(self) -> float:
        return self.training / (self.batch * self.seq_len)

    def to_dict(self) -> dict:
        return {
            "convention": self.convention.name,
            "seq_len": self.seq_len,
            "batch": self.batch,
            "forward_flops": self.forward,
            "training_flops": self.training,
            "forward_flops_per_token": self.forward_per_token,
            "training_flops_per_token": self.training_per_token,
            "components": self.components,
            "steps": self.steps,
        }


def build_meta_model(cfg: ModelConfig) -> nn.Module:
    from looplm.model import LoopLM

    with torch.device("meta"):
        return LoopLM(cfg)


def count_flops(
    model_or_cfg: Union[nn.Module, ModelConfig],
    seq_len: Optional[int] = None,
    *,
    batch: int = 1,
    convention: Union[str, Convention] = "default",
) -> FlopReport:
    """Forward (and training) FLOPs of a full forward on [batch, seq_len] (default:
    ``max_seq_len``), looped blocks counted once per iteration."""
    conv = get_convention(convention)
    model = build_meta_model(model_or_cfg) if isinstance(model_or_cfg, ModelConfig) else model_or_cfg
    seq_len = seq_len or model.cfg.max_seq_len
    components: dict[str, float] = {}
    steps: dict[str, float] = {}
    costs: dict[str, Cost] = {}
    for step in execution_plan(model, seq_len, batch):
        if step.component == "head" and not conv.head:
            cost = Cost()
        else:
            cost = module_cost(step.module, step.call)
        flops = cost.flops(conv)
        components[step.component] = components.get(step.component, 0) + flops
        steps[step.name] = steps.get(step.name, 0) + flops
        costs[step.component] = costs.get(step.component, Cost()) + cost
    return FlopReport(conv, seq_len, batch, sum(components.values()), components, steps, costs)


def iter_plan_costs(model: nn.Module, seq_len: int, batch: int = 1) -> Iterator[tuple[Step, Cost]]:
    for step in execution_plan(model, seq_len, batch):
        yield step, module_cost(step.module, step.call)


# rules for looplm's modules live in one place, registered on import
from looplm.accounting import rules as _rules  # noqa: E402,F401
