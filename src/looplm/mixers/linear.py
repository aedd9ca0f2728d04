"""What every linear mixer shares (LA, RetNet, GLA, HGRN2, Mamba2, DeltaNet, GDN, KDA).

Layers: whole-number widths (:func:`whole`) and fla's input projections with optional
causal short convolutions (:class:`ProjectedMixer`, keeping fla's parameter names
``q_proj`` / ``q_conv1d`` ...). Configs: the head count, norm epsilon and chunk size every
linear kind has, and the checks on widths (:class:`LinearMixerConfig`), written once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Optional

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost, module_cost
from looplm.config_base import ConfigError, check
from looplm.mixers.config import MixerConfig
from looplm.modules.shape import BlockShape
from looplm.modules.short_conv import ShortConvolution
from looplm.modules.norm import GatedRMSNorm, RMSNorm
from looplm.ops.fla_hopper import GatedOp


def is_whole(value: float) -> bool:
    """Whether ``value`` is a whole number; widths such as d·0.5 are float products, so to 1e-6."""
    return abs(value - round(value)) <= 1e-6


def whole(value: float, name: str) -> int:
    """``value`` (a width scaled by ``name``) as an int, or ValueError when it is not whole."""
    if not is_whole(value):
        raise ValueError(f"the width scaled by {name} is {value}, which must be a whole number")
    return round(value)


def init_dt_bias(n: int, dt_min: float = 0.001, dt_max: float = 0.1, floor: float = 1e-4) -> torch.Tensor:
    """softplus⁻¹(Δ) with Δ log-uniform in [dt_min, dt_max], at least ``floor`` (Mamba2's
    dt_bias init, shared by GDN and KDA as in fla)."""
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


class ProjectedMixer(nn.Module):
    """Base of the linear layers that project x into named streams (q, k, v; HGRN2's q, f,
    i), each optionally followed by a causal short convolution. Modules are named as in
    fla's layers, ``{name}_proj`` and ``{name}_conv1d``, so state dicts move between the two.
    """

    #: the op family a subclass runs: "delta" (the delta rule) or "decay" (diagonal decay)
    op_family = ""
    #: its decay gate: None, "head" (one log α per head and position) or "channel" (one per
    #: key channel); gated ops may need their fla backward checked (looplm.ops.fla_hopper)
    decay_gate: Optional[str] = None

    def gated_op(self) -> Optional[GatedOp]:
        """The gated op this layer trains through (None without a decay gate)."""
        if self.decay_gate is None:
            return None
        return GatedOp(self.op_family, self.decay_gate == "channel", self.num_heads, self.head_k_dim, self.head_v_dim)

    def add_projections(self, hidden_size: int, widths: dict[str, int]) -> None:
        """``{name}_proj = Linear(hidden_size, width)`` without bias, in ``widths``' order."""
        self.streams, self.use_short_conv = tuple(widths), False
        self._derived: Optional[tuple[tuple, dict[str, Any]]] = None  # see derived()
        for name, width in widths.items():
            self.add_module(f"{name}_proj", nn.Linear(hidden_size, width, bias=False))

    def add_short_convs(self, widths: dict[str, int], use_short_conv: bool, conv_size: int, conv_bias: bool,
                        activation: Optional[str]) -> None:
        """``{name}_conv1d`` over each stream when ``use_short_conv`` (created after whatever the
        subclass adds between, so parameters are created in fla's order)."""
        self.use_short_conv = use_short_conv
        if use_short_conv:
            for name, width in widths.items():
                self.add_module(f"{name}_conv1d", ShortConvolution(width, conv_size, bias=conv_bias,
                                                                   activation=activation))

    def project(
        self, x: torch.Tensor, conv: Optional[tuple[torch.Tensor, ...]], valid: Optional[torch.Tensor]
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        """x [B, T, hidden] -> (each stream [B, T, width], the streams' new convolution states,
        empty without short convolutions). conv: the previous states in stream order, or None;
        valid [B, T]: False on left padding (convolved as zeros)."""
        streams = [self.get_submodule(f"{name}_proj")(x) for name in self.streams]
        if not self.use_short_conv:
            return streams, ()
        previous = conv if conv else (None,) * len(streams)
        out = [self.get_submodule(f"{name}_conv1d")(s, c, valid) for name, s, c in zip(self.streams, streams, previous)]
        return [y for y, _ in out], tuple(state for _, state in out)

    def derived(self, build: Callable[[], dict[str, Any]], tag: Any = None) -> dict[str, Any]:
        """Tensors ``build`` derives from this layer's parameters (fused projections, folded
        constants), rebuilt only when a parameter changes: a new storage, dtype or device, or
        an in-place update (the version counter an optimizer step or ``load_state_dict``
        bumps). The parameters themselves stay fla's, so checkpoints are unchanged. While
        autograd records they are rebuilt at every call, so that gradients reach the
        parameters (the cost of one ``cat``), and nothing is kept. An in-place write through ``p.data`` bumps no
        version counter and goes unseen: write under ``torch.no_grad()`` instead. While
        torch.compile traces (a compiled decoding step) the cache is taken as it is, unchecked
        (the eager prefill has filled it: :meth:`DeltaRuleMixer.forward`). ``tag``: anything
        else ``build`` depends on (part of the cache key)."""
        params = list(self.parameters())
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            self._derived = None  # training: hold no stale copy of the weights
            return build()
        if torch.compiler.is_compiling():  # a compiled decoding step: no host checks in the graph
            return build() if self._derived is None else self._derived[1]
        key = (tag, *((p.data_ptr(), p.dtype, p.device, 0 if p.is_inference() else p._version) for p in params))
        if self._derived is None or self._derived[0] != key:
            self._derived = (key, build())
        return self._derived[1]

    def runs_per_head(self, child: nn.Module, heads: int, head_width: int) -> bool:
        """Whether ``child`` runs once per head, not once per position (FLOP accounting): an
        output norm whose width is one head's."""
        return isinstance(child, (RMSNorm, GatedRMSNorm)) and child.weight.shape[0] == head_width and heads > 1

    def children_flop_cost(self, call: Call, heads: int, head_width: int) -> Cost:
        """The children once per position, except what :meth:`runs_per_head` (``head_width``
        wide, ``heads`` of them per position)."""
        cost = Cost()
        per_head = Call(call.batch, call.tokens * heads, call.keys * heads, width=call.width)
        for child in self.children():
            cost = cost + module_cost(child, per_head if self.runs_per_head(child, heads, head_width) else call)
        return cost


@dataclasses.dataclass(frozen=True)
class LinearMixerConfig(MixerConfig):
    """Fields every linear mixer config shares. ``num_heads`` null: the model's n_heads;
    ``chunk_size``: positions per chunk of the training op, allowed by that op's rule
    (``chunk_rule``, the function the op itself checks with)."""

    num_heads: Optional[int] = None
    norm_eps: float = 1e-5
    chunk_size: int = 64

    chunk_rule: ClassVar[Callable[[int], Optional[str]]]

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.num_heads is None or self.num_heads >= 1, "model.mixer.num_heads", self.num_heads,
              "null (the model's n_heads) or an integer >= 1")
        check(self.norm_eps > 0, "model.mixer.norm_eps", self.norm_eps, "a number > 0")
        allowed = type(self).chunk_rule(self.chunk_size)
        check(allowed is None, "model.mixer.chunk_size", self.chunk_size, f"{allowed}, e.g. 64")

    def heads(self, shape: BlockShape) -> int:
        return self.num_heads or shape.n_heads

    def kv_heads(self, shape: BlockShape, num_kv_heads: Optional[int]) -> int:
        """Key/value heads: ``num_kv_heads``, else the model's kv heads when this mixer has the
        model's head count (GQA carries over), else one per head."""
        heads = self.heads(shape)
        return num_kv_heads or (shape.kv_heads if heads == shape.n_heads else heads)

    def check_expands(self, shape: BlockShape, heads: int, **expands: float) -> None:
        """ConfigError unless d_model·expand is a whole multiple of ``heads`` for each expand."""
        for name, expand in expands.items():
            width = shape.d_model * expand
            if not is_whole(width) or round(width) % heads:
                raise ConfigError(f"model.mixer.{name}", expand,
                                  f"a factor making d_model·{name} = {width:g} a whole multiple of num_heads={heads}")


def check_expands_positive(**expands: float) -> None:
    """ConfigError unless each expand factor is > 0."""
    for name, expand in expands.items():
        check(expand > 0, f"model.mixer.{name}", expand, "a number > 0")


def check_conv(conv_size: int) -> None:
    """ConfigError unless the short-convolution width is >= 1."""
    check(conv_size >= 1, "model.mixer.conv_size", conv_size, "an integer >= 1")


def linear_core_cost(call: Call, heads: int, dk: int, dv: int, chunk: int, delta: bool) -> Cost:
    """FLOPs of a linear mixer's core, per head and position.

    Recurrence: S_t = α_t S_{t-1} + k_t v_tᵀ (dk·dv MACs) and o_t = S_tᵀ q_t (dk·dv); the
    delta rule adds the prediction S_{t-1}ᵀ k_t (dk·dv).
    Chunkwise (what trains, chunk C): intra-chunk q kᵀ (C·dk) and scores·v (C·dv) over
    the full C × C block, the inter-chunk read q S (dk·dv) and the state update kᵀ v
    (dk·dv); the delta rule (WY form) adds k kᵀ (C·dk), applying the C × C transform
    to k and v (C·(dk + dv)) and w S (dk·dv)."""
    C = min(chunk, call.tokens)
    n = call.rows * heads
    if delta:
        recurrent = 3 * dk * dv
        chunked = C * dk + C * (dk + dv) + C * (dk + dv) + 3 * dk * dv
    else:
        recurrent = 2 * dk * dv
        chunked = C * (dk + dv) + 2 * dk * dv
    return Cost(mixer_chunk=n * chunked, mixer_recurrent=n * recurrent)
