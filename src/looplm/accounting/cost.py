"""What a FLOP rule returns, how rules are found, and how a module describes its calls:
the core that the plan's walker (:mod:`looplm.accounting.flops`) and every module's own
rule build on. Imports nothing of the model, so the modules can import it.

A module's rule sits beside it, as a method ``flop_cost(self, call: Call) -> Cost`` of its
class; torch's built-in modules (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``,
``nn.Conv1d``, ``nn.Identity``/``nn.Dropout``) have theirs in a small registry here
(:func:`register_flop_rule`). A module without a rule costs the sum of its children, each
applied once to every position; a module with parameters of its own, no children and no
rule is an error (its arithmetic would go uncounted). A cost keeps its terms apart (MACs,
score/value products, norms, biases, residual and state elementwise ops) so that a
:class:`~looplm.accounting.conventions.Convention` only weighs them.

A loop axis describes the module calls of one macro step as :class:`Step` rows, beside the
code that runs them (``topology.start_calls / step_calls``, ``streams.step_calls``,
``halting.step_calls``, ``resolution.pass_calls``, ``step_embedding.step_calls``); the
execution plan (:mod:`looplm.accounting.plan`) concatenates them in the order the loop
runs them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, runtime_checkable

from torch import nn

from looplm.accounting.conventions import Convention


@dataclasses.dataclass
class Cost:
    """Operation counts of one module call, per term.

    mac: multiply-accumulates of projections and other matmuls. attn_full / attn_causal:
    MACs of the score and value products over all T × S pairs / over the pairs a query
    may see. mixer_chunk / mixer_recurrent: MACs of a linear mixer's core in its chunkwise
    form / as the token recurrence. read_mac: MACs of the MeSH buffer read (Eq. 8's count);
    read_unrolled_mac: MACs of the same read as looplm runs it, unrolled (Eq. 7: the
    coefficients and the weighted sum of the values written so far). norm: norm
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
    read_unrolled_mac: float = 0
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
            + (c.read_flops_per_mac or c.flops_per_mac) * (self.read_mac if c.mesh_read == "buffer"
                                                            else self.read_unrolled_mac)
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
    ``step`` for topologies. ``iteration``: loop iteration (-1 outside the loop).
    ``reuses_first_step_kv``: a later loop step whose softmax attention reads the keys and
    values of the first step (Mixture-of-Recursions' recursive KV sharing; the halting
    rule says which steps, ``Halting.reuses_first_step_kv``), so it projects queries only.
    ``training``: a training-mode forward, for a rule whose module works more in training
    (DSA scores every query for its indexer loss; the class sets ``flop_cost_reads_training``).
    ``last``: the forward's last macro step. ``state_grad``: whether the loop state entering
    the step carries a gradient (not at the first step of a truncated backward's window, nor
    after a macro step without gradient), so a call reading it directly backpropagates into
    its weights alone."""


    batch: int
    tokens: int
    keys: int
    phase: str = "step"
    iteration: int = -1
    width: int = 0  # d_model, for modules without a parameter that says it
    reuses_first_step_kv: bool = False
    training: bool = False
    last: bool = False
    state_grad: bool = True

    @property
    def rows(self) -> int:
        return self.batch * self.tokens


@dataclasses.dataclass(frozen=True)
class Step:
    """One module call on the unrolled path: ``component`` (embedding, prelude, core,
    coda, topology, streams, step_embedding, halting, final_norm, head, resolution),
    ``name`` (e.g. ``core.1``), the module and how it is called.

    ``slot``: for core blocks and the per-pass additions, the pass's key t·passes + i
    (macro step t, pass i of it), as the model names it in the cache and the attention
    record. ``grad``: whether a training step backpropagates through the call (False for
    the first H − 1 cycles of ``streams.no_grad_cycles`` and for Q-halt's target readout,
    both run under ``torch.no_grad``, and for calls whose output reaches no loss): training
    counts it once, not ``training_multiplier`` times. ``input_grad``: whether the backward
    also computes the gradient of the call's input; false where the input carries none (a
    detached state, the frozen LM's states under Ouro's Stage II): training counts the call
    twice, forward and weight gradient. ``targets_only``: the call runs only in a forward
    given targets (training, or an evaluation loss): Q-halt's per-step norm + LM head that builds its BCE target (no
    gradient), the exit gate's per-step LM head of its expected objective (gradient)."""

    component: str
    name: str
    module: nn.Module
    call: Call
    slot: Optional[int] = None
    grad: bool = True
    targets_only: bool = False
    input_grad: bool = True


def in_pass(steps: list[Step], *, slot: Optional[int] = None, grad: bool = True) -> list[Step]:
    """``steps`` as they run inside one core pass: named by its ``slot`` (where they have
    none yet) and without gradient where the pass runs under ``torch.no_grad``."""
    return [dataclasses.replace(s, slot=s.slot if s.slot is not None else slot, grad=s.grad and grad) for s in steps]


@runtime_checkable
class Counted(Protocol):
    """A module whose class carries its FLOP rule: the cost of one call described by ``call``."""

    def flop_cost(self, call: Call) -> Cost: ...


Rule = Callable[[nn.Module, Call], Cost]
_RULES: dict[type, Rule] = {}


def register_flop_rule(*types: type) -> Callable[[Rule], Rule]:
    """Register ``rule(module, call) -> Cost`` for modules of ``types`` (and subclasses)
    whose class cannot carry a ``flop_cost`` method: torch's own modules. A module of
    looplm defines ``flop_cost(self, call)`` instead."""

    def wrap(rule: Rule) -> Rule:
        for t in types:
            _RULES[t] = rule
        return rule

    return wrap


def module_cost(module: nn.Module, call: Call) -> Cost:
    """Cost of one call of ``module``: its ``flop_cost(call)`` method, else the registered
    rule of its type (nearest in the MRO), else the sum of its children's costs (each
    child applied once to every position)."""
    if isinstance(module, Counted):
        return module.flop_cost(call)
    for klass in type(module).__mro__:
        if klass in _RULES:
            return _RULES[klass](module, call)
    if next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None:
        raise TypeError(
            f"no FLOP rule for {type(module).__qualname__}: a module with parameters of its own and no children "
            "needs one; define flop_cost(self, call) -> Cost on its class (looplm.accounting.cost)"
        )
    return children_cost(module, call)


def children_cost(module: nn.Module, call: Call) -> Cost:
    total = Cost()
    for child in module.children():
        total = total + module_cost(child, call)
    return total


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



# ------------------------------------------------------------------ torch's built-in modules


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
