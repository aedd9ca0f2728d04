"""What a FLOP rule returns and how rules are found: the core both the plan's walker
(:mod:`looplm.accounting.flops`) and the rules (:mod:`looplm.accounting.rules`) build on.

A rule is registered by module type (:func:`register_flop_rule`) and returns a
:class:`Cost` for one :class:`Call` of its module; a module without a rule costs the sum of
its children, each applied once to every position. A cost keeps its terms apart (MACs,
score/value products, norms, biases, residual and state elementwise ops) so that a
:class:`~looplm.accounting.conventions.Convention` only weighs them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

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

