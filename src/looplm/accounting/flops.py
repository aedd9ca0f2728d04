"""FLOP counter over the unrolled computation, with a per-component breakdown.

The counter walks the model's execution plan (:func:`execution_plan`: embed (and a learned
position table), prelude blocks, the topology's start, each macro step's core passes with
that iteration's mixer view (one, or H·(L + 1) with two streams, each with its stream
and step-signal additions), the topology step and the halting rule, coda, final norm,
head) and asks a *rule* for each module's cost. Rules are registered by module type
(:func:`register_flop_rule`); a module without a rule costs the sum of its children, each
applied once to every position. A rule returns
a :class:`Cost` whose terms are kept apart (MACs, score/value products, norms, biases,
residual and state elementwise ops) so that a :class:`~looplm.accounting.conventions.Convention`
only weighs them. Looped blocks are counted once per pass (LT2's convention), every
position running every macro step (full compute; :func:`realised_block_passes` reads what
adaptive halting actually needed from a model output). A new mechanism (resolution
schedules, SGT head passes, halting) adds plan steps or a rule, not a branch here.
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
    FLOPs. bias: bias additions (and learned vectors added to every position: position
    rows, step embeddings). residual: the block's residual additions. state: elementwise
    ops combining loop states (topology, stream inputs, ACT readout). embed: the embedding
    lookup as one-hot MACs (V·d per token)."""

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
    coda, topology, streams, step_embedding, halting, final_norm, head, ...), ``name``
    (e.g. ``core.1``), the module and how it is called.

    ``slot``: for core blocks and the per-pass additions, the pass's key t·passes + i
    (macro step t, pass i of it), as the model names it in the cache and the attention
    record. ``grad``: whether a training step backpropagates through the call (False for
    the first H − 1 cycles of ``streams.no_grad_cycles`` and for Q-halt's target readout,
    both run under ``torch.no_grad``): training counts it once, not ``training_multiplier``
    times. ``targets_only``: the call runs only in a forward given targets (training, or
    an evaluation loss): Q-halt's per-step norm + LM head that builds its BCE target."""

    component: str
    name: str
    module: nn.Module
    call: Call
    slot: Optional[int] = None
    grad: bool = True
    targets_only: bool = False


def execution_plan(model: nn.Module, seq_len: int, batch: int = 1, *, targets: bool = False) -> list[Step]:
    """The module calls of one full forward of ``model`` (a LoopLM) on [batch, seq_len],
    in order, loops unrolled, every position running every macro step (full compute).

    Embedding: the token table, plus a learned position table (``model.position: learned``)
    and its addition. The loop, per macro step t: ``passes`` core passes (one; or
    H·(L + 1) with two streams, slot t·passes + i), each preceded by its stream addition
    (two streams: X + Y + Z for a reasoning pass, Y + Z for a solution pass) and the step
    signal e_t; the topology step (single stream; two streams never call the topology);
    the halting rule's call (ACT: the unit d -> 1 and the readout accumulation Σ w·h;
    Q-halt: the q head d -> 1). ``targets``: also list the calls that run only in a forward
    given targets, flagged ``targets_only`` (Q-halt: the final norm and LM head on the
    solution at every macro step, under ``torch.no_grad``).

    A multi-resolution iteration t (``model.resolution``, spiralformer.txt Alg. 1) adds S↓
    on the tokens of its L_t complete chunks, runs the core on L_t positions
    (:func:`~looplm.resolution.core_lengths`) and adds S↑ with the causal shift on all T
    positions; the topology step runs at full resolution. A grown block (SGT) is
    counted by its type's rule in :mod:`looplm.accounting.rules`."""
    from looplm.modules.block import Block  # noqa: F401  (rules registered below)

    cfg = model.cfg
    full = Call(batch, seq_len, seq_len, width=cfg.d_model)
    plan = [Step("embedding", "embed", model.embed, full)]
    if getattr(model, "pos_embed", None) is not None:
        plan.append(Step("embedding", "pos_embed", _PositionCall(model.pos_embed), full))
    for j, block in enumerate(model.prelude):
        plan.append(Step("prelude", f"prelude.{j}", _BlockCall(block, 0), full))
    if model.topology is not None:
        plan.extend(_loop_plan(model, seq_len, batch, targets))
    for j, block in enumerate(model.coda):
        plan.append(Step("coda", f"coda.{j}", _BlockCall(block, 0), full))
    plan.append(Step("final_norm", "norm", model.norm, full))
    plan.append(Step("head", "head", model.head, full))
    return plan


def _loop_plan(model: nn.Module, seq_len: int, batch: int, targets: bool) -> list[Step]:
    """The recurrence of :func:`execution_plan`, as ``LoopLM._loop`` runs it."""
    from looplm.halting import Halting, QHalting
    from looplm.resolution.schedule import core_lengths
    from looplm.streams import TwoStream

    cfg = model.cfg
    layout = cfg.loop
    full = Call(batch, seq_len, seq_len, width=cfg.d_model)
    resolution = getattr(model, "resolution", None)
    lengths = core_lengths(resolution.schedule, seq_len) if resolution is not None else [seq_len] * layout.iterations
    streams = getattr(model, "streams", None)
    two = isinstance(streams, TwoStream)
    passes = streams.passes if streams is not None else 1
    quiet = (streams.outer - 1) * (streams.inner + 1) if two and streams.no_grad_cycles else 0  # no-grad passes
    step_embedding = getattr(model, "step_embedding", None)
    signal = step_embedding is not None and step_embedding.enabled
    halting = getattr(model, "halting", None)
    halts = halting is not None and type(halting) is not Halting  # ``none`` computes nothing
    plan: list[Step] = []
    if not two:  # two streams start from Y⁰, Z⁰ (no compute) and never call the topology
        plan.append(Step("topology", "topology.start", model.topology, dataclasses.replace(full, phase="start")))
    for t in range(layout.iterations):
        n = lengths[t]  # L_t positions: T at full resolution, the complete chunks otherwise
        call = Call(batch, n, n, iteration=t, width=cfg.d_model)
        at = dataclasses.replace(full, iteration=t)
        scaled = resolution is not None and not resolution.identity(t)
        stack = model.core[0 if cfg.share_core else t]
        for i in range(passes):
            slot, grad = t * passes + i, i >= quiet
            if two:  # Z <- f(X + Y + Z): the first L passes of a cycle; Y <- f(Y + Z): its last
                phase = "solve" if (i + 1) % (streams.inner + 1) == 0 else "reason"
                plan.append(Step("streams", f"streams.{slot}", streams, dataclasses.replace(at, phase=phase), slot, grad))
            if signal:  # x + e_t on the core's input, at full resolution
                plan.append(Step("step_embedding", f"step_embedding.{slot}", step_embedding, at, slot, grad))
            if scaled:
                g = resolution.schedule[t].chunk
                down = Call(batch, n * g, n * g, phase="down", iteration=t, width=cfg.d_model)
                plan.append(Step("resolution", f"resolution.down.{t}", _ResolutionCall(resolution, t), down, slot, grad))
            for j, block in enumerate(stack):
                plan.append(Step("core", f"core.{j}", _BlockCall(block, t), call, slot, grad))
            if scaled:
                up = dataclasses.replace(full, phase="up", iteration=t)
                plan.append(Step("resolution", f"resolution.up.{t}", _ResolutionCall(resolution, t), up, slot, grad))
        if not two:
            plan.append(Step("topology", f"topology.step.{t}", model.topology, at))
        if halts:
            plan.append(Step("halting", f"halting.{t}", halting, at))
            if targets and isinstance(halting, QHalting) and halting.loss_weight > 0:
                # Q-halt's BCE target 1[argmax head(norm(Y)) = target], every step, under no_grad
                plan.append(Step("final_norm", f"halting.target.norm.{t}", model.norm, at, grad=False, targets_only=True))
                plan.append(Step("head", f"halting.target.head.{t}", model.head, at, grad=False, targets_only=True))
    return plan


class _PositionCall(nn.Module):
    """A learned position table's lookup (as the token embedding's) and its addition to
    the token embeddings."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table


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
    streams, step_embedding, halting, final_norm, head), summing to ``forward``; steps:
    forward FLOPs per plan step name, summed over iterations; costs: the unweighted terms
    per component. ``forward`` is an inference forward (no targets).

    targets_only: forward FLOPs of the calls that run only when the forward is given
    targets (Q-halt's per-step target readout), per plan step name; they are not in
    ``forward`` or ``components``, they are in ``training`` (once: they run under
    ``torch.no_grad``) and in :attr:`forward_with_targets`. no_grad: the part of
    ``forward`` that training runs without gradient (TRM's no-grad cycles), counted once
    in ``training``. training: see :attr:`training`."""

    convention: Convention
    seq_len: int
    batch: int
    forward: float
    components: dict[str, float]
    steps: dict[str, float]
    costs: dict[str, Cost]
    targets_only: dict[str, float] = dataclasses.field(default_factory=dict)
    no_grad: float = 0.0
    embedding_matmul: float = 0.0  # the embedding lookups' one-hot matmul FLOPs (``convention.embedding``)

    @property
    def training(self) -> float:
        """One training step's FLOPs: ``training_multiplier`` × the forward of every call
        the backward runs through; an embedding counted as a matmul (``convention.embedding``)
        2 × its forward (forward and weight gradient, no input gradient); calls run under
        ``torch.no_grad`` (no-grad cycles, Q-halt's target readout) once."""
        extra = sum(self.targets_only.values())
        grad = self.forward - self.no_grad - self.embedding_matmul
        return self.convention.training_multiplier * grad + 2 * self.embedding_matmul + self.no_grad + extra

    @property
    def forward_with_targets(self) -> float:
        """A forward given targets (an evaluation loss): ``forward`` + ``targets_only``."""
        return self.forward + sum(self.targets_only.values())

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
            "targets_only": self.targets_only,
            "no_grad_flops": self.no_grad,
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
    ``max_seq_len``), looped blocks counted once per pass, every position running every
    macro step (what adaptive halting saved: :func:`realised_block_passes`)."""
    conv = get_convention(convention)
    model = build_meta_model(model_or_cfg) if isinstance(model_or_cfg, ModelConfig) else model_or_cfg
    seq_len = seq_len or model.cfg.max_seq_len
    components: dict[str, float] = {}
    steps: dict[str, float] = {}
    costs: dict[str, Cost] = {}
    targets_only: dict[str, float] = {}
    no_grad = embedding_matmul = 0.0
    for step in execution_plan(model, seq_len, batch, targets=True):
        if step.component == "head" and not conv.head:
            cost = Cost()
        else:
            cost = module_cost(step.module, step.call)
        flops = cost.flops(conv)
        if step.targets_only:
            targets_only[step.name] = targets_only.get(step.name, 0) + flops
            continue
        components[step.component] = components.get(step.component, 0) + flops
        steps[step.name] = steps.get(step.name, 0) + flops
        costs[step.component] = costs.get(step.component, Cost()) + cost
        if not step.grad:
            no_grad += flops
        elif conv.embedding:
            embedding_matmul += conv.flops_per_mac * cost.embed
    return FlopReport(conv, seq_len, batch, sum(components.values()), components, steps, costs,
                      targets_only=targets_only, no_grad=no_grad, embedding_matmul=embedding_matmul)


def iter_plan_costs(model: nn.Module, seq_len: int, batch: int = 1) -> Iterator[tuple[Step, Cost]]:
    for step in execution_plan(model, seq_len, batch):
        yield step, module_cost(step.module, step.call)


def realised_block_passes(output, mask: Optional[torch.Tensor] = None) -> float:
    """Mean block passes per token that a forward's positions needed, from
    ``output.record["block_passes"]`` ([B, T]: prelude + core·steps·passes + coda, steps
    being the macro steps the position ran before halting). ``mask`` [B, T] (e.g. the
    attention mask): average over its true positions only.

    The execution plan and :func:`count_flops` count full compute, ``cfg.block_passes``
    per token; this is the adaptive share of it. The batched forward itself computes every
    position until the last one halts (frozen positions are recomputed and discarded), so
    its executed passes are the maximum over positions, not this mean (without a cache
    the loop stops once every position has halted)."""
    record = getattr(output, "record", None) or {}
    if "block_passes" not in record:
        raise ValueError("output.record has no 'block_passes': only a looped model records its realised passes "
                         "(a dense model runs every block once per token)")
    passes = record["block_passes"][-1].float()
    if mask is None:
        return float(passes.mean())
    mask = mask.to(torch.bool)
    if not bool(mask.any()):
        raise ValueError("mask selects no position")
    return float(passes[mask].mean())


# rules for looplm's modules live in one place, registered on import
from looplm.accounting import rules as _rules  # noqa: E402,F401
