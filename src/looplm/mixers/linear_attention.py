"""Linear attention (Katharopoulos et al. 2020), and what the diagonal-decay mixers share.

The diagonal-decay family — LA, RetNet, GLA, HGRN2, Mamba2 — all run one op,

    S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ,    o_t = S_tᵀ (scale · q_t)               (LT2 Table 1)

(``looplm.ops.decay``), and differ in how they compute q, k, v and α from x and in their
output gates and norms. :class:`DecayMixer` holds the shared part: the op on the right
backend (flash-linear-attention's Triton kernels on CUDA when installed, else the
chunkwise PyTorch form for several positions and the recurrent step for one), left
padding (a padded position writes nothing and decays nothing), and the decoding state
:class:`DecayState` (recurrent matrix + short-convolution inputs).

:class:`LinearAttention` is fla's ``fla.layers.LinearAttention`` (parameter names
included, so weights move between the two): q/k/v projections, a feature map on q and k
(fla's default: the learned ``elementwise_product`` map), α = 1, no denominator
(fla's default ``do_feature_map_norm=False``), a per-head RMSNorm of o and o_proj.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost, children_cost
from looplm.config_base import check
from looplm.ops.backend import log_backend, use_fla
from looplm.mixers.base import MixerContext
from looplm.mixers.linear import (
    LinearMixerConfig,
    ProjectedMixer,
    check_conv,
    check_expands_positive,
    linear_core_cost,
    whole,
)
from looplm.modules.norm import GatedRMSNorm, RMSNorm
from looplm.modules.shape import BlockShape
from looplm.ops.decay import chunk_decay, chunk_size_rule, fla_decay, recurrent_decay

FEATURE_MAPS = ("elementwise_product", "elu", "relu", "identity")


@dataclasses.dataclass
class DecayState:
    """Decoding state of a diagonal-decay mixer after ``length`` positions.

    recurrent: S [B, H, K, V] (float32). conv: the last conv_size - 1 inputs of each short
    convolution ([B, channels, conv_size - 1] each; empty without short convolutions).
    """

    recurrent: torch.Tensor
    conv: tuple[torch.Tensor, ...]
    length: int

    def crop(self, length: int) -> "DecayState":
        if length >= self.length:
            return self
        raise ValueError(
            f"cannot crop a linear-attention state from {self.length} to {length} positions: its recurrent "
            f"matrix S summarises every position and cannot be rewound; run the first {length} positions again"
        )

    def select(self, index: torch.Tensor) -> "DecayState":
        return DecayState(self.recurrent[index], tuple(c[index] for c in self.conv), self.length)

    def static(self, capacity: int) -> "DecayState":
        """Already static: S and the conv windows keep their shapes at any length (a static
        cache copies each step's values into these tensors, :mod:`looplm.cache`)."""
        return self


def positions(ctx: MixerContext) -> torch.Tensor:
    """Position ids [B, T] of the new tokens, counting real tokens only (left padding gets
    0), as the model computes them for its rotary tables."""
    every = (ctx.valid.long().cumsum(1) - 1).clamp(min=0)
    return every.index_select(1, ctx.slots) if ctx.slots is not None else every[:, ctx.past :]


class DecayMixer(ProjectedMixer):
    """Base of the diagonal-decay layers: the op on its backend and left padding.

    A subclass sets ``kind`` and ``chunk_size`` and names its output projection
    ``o_proj`` (looplm's depth-scaled init finds W_O by that name).
    """

    kind = "linear_attention"
    op_family = "decay"
    chunk_size = 64

    def set_heads(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int], expand_k: float,
                  expand_v: float) -> None:
        """fla's multi-head shape: key_dim = hidden·expand_k and value_dim = hidden·expand_v
        split over num_heads; keys and values over num_kv_heads, each serving ``groups``
        consecutive heads."""
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        self.key_dim = whole(hidden_size * expand_k, "expand_k")
        self.value_dim = whole(hidden_size * expand_v, "expand_v")
        if self.key_dim % num_heads or self.value_dim % num_heads:
            raise ValueError(
                f"key_dim={self.key_dim} and value_dim={self.value_dim} must be divisible by num_heads={num_heads}"
            )
        self.head_k_dim, self.head_v_dim = self.key_dim // num_heads, self.value_dim // num_heads
        self.groups = num_heads // self.num_kv_heads

    def qkv_widths(self) -> dict[str, int]:
        """q over every head; k and v over the key/value heads (fla's layers)."""
        return {"q": self.key_dim, "k": self.key_dim // self.groups, "v": self.value_dim // self.groups}

    def add_gated_layer(self, hidden_size: int, use_short_conv: bool, conv_size: int, conv_bias: bool,
                        use_output_gate: bool, norm_eps: float) -> None:
        """The layer fla's GLA and RetNet share around their op: q/k/v, optional SiLU short
        convolutions on them, o_proj, and a per-head RMSNorm of o, gated by SiLU(g_proj(x))
        with ``use_output_gate``."""
        self.use_output_gate = use_output_gate
        self.add_projections(hidden_size, self.qkv_widths())
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.add_short_convs(self.qkv_widths(), use_short_conv, conv_size, conv_bias, activation="silu")
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        if use_output_gate:
            self.g_norm_swish_gate = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        else:
            self.g_norm = RMSNorm(self.head_v_dim, eps=norm_eps)

    def split_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections [B, T, width] -> q, k [B, T, H, head_k_dim] and v [B, T, H,
        head_v_dim], each key/value head repeated for its group of query heads."""
        B, T, _ = q.shape
        q = q.view(B, T, self.num_heads, self.head_k_dim)
        k = repeat_kv(k.view(B, T, self.num_kv_heads, self.head_k_dim), self.groups)
        v = repeat_kv(v.view(B, T, self.num_kv_heads, self.head_v_dim), self.groups)
        return q, k, v

    def gated_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, V] -> o_proj of the per-head norm, gated by SiLU(g_proj(x)) with the
        output gate: [B, T, hidden]."""
        B, T = x.shape[:2]
        if self.use_output_gate:
            o = self.g_norm_swish_gate(o, self.g_proj(x).view(B, T, self.num_heads, self.head_v_dim))
        else:
            o = self.g_norm(o)
        return self.o_proj(o.reshape(B, T, self.value_dim))

    @staticmethod
    def mask_padding(
        valid: Optional[torch.Tensor], k: torch.Tensor, log_alpha: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Left padding leaves S unchanged: k = 0 (no write) and log α = 0 (no decay) where
        valid [B, T] is False. k: [B, T, H, K]; log_alpha: [B, T, H(, K)] or None."""
        if valid is None:
            return k, log_alpha
        k = k * valid[:, :, None, None].to(k.dtype)
        if log_alpha is not None:
            log_alpha = torch.where(valid.view(*valid.shape, *([1] * (log_alpha.dim() - 2))), log_alpha, 0.0)
        return k, log_alpha

    def decay(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        log_alpha: Optional[torch.Tensor],
        scale: Optional[float],
        initial_state: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The op: q, k [B, T, H, K]; v [B, T, H, V]; log_alpha [B, T, H(, K)] or None;
        initial_state [B, H, K, V] or None. Returns (o [B, T, H, V], S_T float32).

        On CUDA with fla: its fused recurrent kernel for inference on up to 64 positions
        (fla's layers' rule), its chunked kernel otherwise. On PyTorch: the recurrent step
        for one position, the chunkwise form for more."""
        T = q.shape[1]
        if use_fla(q, gated=self.gated_op()):
            log_backend(self.kind, "fla")
            recurrent = T <= 64 and not torch.is_grad_enabled()
            o, S = fla_decay(q, k, v, log_alpha, scale, initial_state, output_final_state=True, recurrent=recurrent)
            return o, S.float()
        log_backend(self.kind, "torch")
        if T == 1:
            return recurrent_decay(q, k, v, log_alpha, scale, initial_state, output_final_state=True)
        return chunk_decay(q, k, v, log_alpha, scale, initial_state, output_final_state=True,
                           chunk_size=self.chunk_size)

    def runs_per_head(self, child: nn.Module, heads: int, head_width: int) -> bool:
        """Feature maps run per head too (they see one head's width)."""
        return isinstance(child, HadamardFeatureMap) or super().runs_per_head(child, heads, head_width)

    def flop_cost(self, call: Call) -> Cost:
        return (self.children_flop_cost(call, self.num_heads, self.head_v_dim)
                + linear_core_cost(call, self.num_heads, self.head_k_dim, self.head_v_dim, self.chunk_size,
                                    delta=False))


def elu_p1(x: torch.Tensor) -> torch.Tensor:
    """ELU(x) + 1 (Katharopoulos et al. 2020; fla's ``elu_p1``)."""
    return F.elu(x) + 1


class HadamardFeatureMap(nn.Module):
    """φ(x) = layer1(x) ⊙ layer2(x), both Linear(head_dim, head_dim) with bias (fla's
    ``HadamardFeatureMap``, the ``elementwise_product`` map)."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.layer1 = nn.Linear(head_dim, head_dim)
        self.layer2 = nn.Linear(head_dim, head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer1(x) * self.layer2(x)

    def flop_cost(self, call: Call) -> Cost:
        """Both layers on every row of ``call``: the mixer's rule passes one row per head."""
        return children_cost(self, call)


def build_feature_map(name: str, head_dim: int) -> nn.Module:
    if name == "elementwise_product":
        return HadamardFeatureMap(head_dim)
    if name == "elu":
        return _Function(elu_p1)
    if name == "relu":
        return nn.ReLU()
    if name == "identity":
        return nn.Identity()
    raise ValueError(f"feature_map={name!r} is invalid: one of {', '.join(FEATURE_MAPS)}")


class _Function(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, T, H_kv, D] -> [B, T, H_kv·groups, D], each key/value head serving ``groups``
    consecutive query heads (fla's ``repeat(... '(h d) -> (h g) d')``)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


class LinearAttention(DecayMixer):
    """fla's ``LinearAttention`` layer: S_t = S_{t-1} + φ(k_t) v_tᵀ, o_t = S_tᵀ φ(q_t) / √K.

    key_dim = hidden·expand_k and value_dim = hidden·expand_v split over num_heads (key
    and value projections over num_kv_heads, shared by groups of heads). ``feature_map``
    φ: ``elementwise_product`` (learned, fla's default), ``elu`` (ELU + 1), ``relu``,
    ``identity``. ``norm_q`` / ``norm_k`` divide by the feature sum. ``output_norm``:
    per-head ``rmsnorm`` or ``identity``. Shapes: x [B, T, hidden] -> [B, T, hidden].
    """

    kind = "linear_attention"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 8,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        num_kv_heads: Optional[int] = None,
        feature_map: str = "elementwise_product",
        tie_feature_map_qk: bool = False,
        output_norm: str = "rmsnorm",
        norm_q: bool = False,
        norm_k: bool = False,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
    ):
        super().__init__()
        self.set_heads(hidden_size, num_heads, num_kv_heads, expand_k, expand_v)
        self.norm_q, self.norm_k, self.chunk_size = norm_q, norm_k, chunk_size
        self.feature_map_q = build_feature_map(feature_map, self.head_k_dim)
        self.feature_map_k = (
            self.feature_map_q if tie_feature_map_qk else build_feature_map(feature_map, self.head_k_dim)
        )
        self.add_projections(hidden_size, self.qkv_widths())
        if output_norm == "rmsnorm":
            self.norm: nn.Module = RMSNorm(self.head_v_dim, eps=norm_eps)
        elif output_norm == "identity":
            self.norm = nn.Identity()
        else:
            raise ValueError(f"output_norm={output_norm!r} is invalid: 'rmsnorm' or 'identity'")
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[DecayState] = None
    ) -> tuple[torch.Tensor, DecayState]:
        """x: [B, T, hidden] -> ([B, T, hidden], state after these T positions)."""
        B, T, _ = x.shape
        (q, k, v), _ = self.project(x, None, None)
        q, k, v = self.split_heads(q, k, v)
        q, k = self.feature_map_q(q), self.feature_map_k(k)
        if self.norm_q:
            q = q / (q.sum(-1, keepdim=True) + 1e-4)
        if self.norm_k:
            k = k / (k.sum(-1, keepdim=True) + 1e-4)
        k, _ = self.mask_padding(ctx.new_valid if ctx.padded else None, k, None)
        o, S = self.decay(q, k, v, None, None, None if state is None else state.recurrent)
        o = self.norm(o).reshape(B, T, self.value_dim)
        return self.o_proj(o), DecayState(S, (), ctx.valid.shape[1])


# ----------------------------------------------------------------------------- configs
@dataclasses.dataclass(frozen=True)
class DecayMixerConfig(LinearMixerConfig):
    """A diagonal-decay mixer config: its chunk size is the decay op's (any integer >= 1)."""

    chunk_rule = staticmethod(chunk_size_rule)


@dataclasses.dataclass(frozen=True)
class GroupedDecayConfig(DecayMixerConfig):
    """The decay kinds with fla's multi-head shape (LA, RetNet, GLA): key/value widths
    d_model·expand_k / d_model·expand_v over num_heads; ``num_kv_heads`` null: the model's
    kv heads (see :meth:`LinearMixerConfig.kv_heads`)."""

    expand_k: float = 1.0
    expand_v: float = 1.0
    num_kv_heads: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_expands_positive(expand_k=self.expand_k, expand_v=self.expand_v)
        check(self.num_kv_heads is None or self.num_kv_heads >= 1, "model.mixer.num_kv_heads", self.num_kv_heads,
              "null (the model's kv heads) or an integer >= 1")

    def head_counts(self, shape: BlockShape) -> tuple[int, int]:
        """(num_heads, num_kv_heads) on ``shape``, checked against the widths."""
        heads, kv_heads = self.heads(shape), self.kv_heads(shape, self.num_kv_heads)
        check(heads % kv_heads == 0, "model.mixer.num_kv_heads", kv_heads, f"a divisor of num_heads={heads}")
        self.check_expands(shape, heads, expand_k=self.expand_k, expand_v=self.expand_v)
        return heads, kv_heads


@dataclasses.dataclass(frozen=True)
class GatedDecayConfig(GroupedDecayConfig):
    """The layer fla's GLA and RetNet share (:meth:`DecayMixer.add_gated_layer`): optional
    SiLU short convolutions on q, k, v, and the output gate."""

    use_short_conv: bool = False
    conv_size: int = 4
    conv_bias: bool = False
    use_output_gate: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_conv(self.conv_size)


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig(GroupedDecayConfig):
    """Linear attention (fla ``LinearAttention``)."""

    kind: str = "linear_attention"
    feature_map: str = "elementwise_product"
    tie_feature_map_qk: bool = False
    output_norm: str = "rmsnorm"
    norm_q: bool = False
    norm_k: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.feature_map in FEATURE_MAPS, "model.mixer.feature_map", self.feature_map,
              f"one of {', '.join(FEATURE_MAPS)}")
        check(self.output_norm in ("rmsnorm", "identity"), "model.mixer.output_norm", self.output_norm,
              "'rmsnorm' or 'identity'")

    def build(self, shape: BlockShape) -> nn.Module:
        heads, kv_heads = self.head_counts(shape)
        return LinearAttention(
            shape.d_model, heads, self.expand_k, self.expand_v, num_kv_heads=kv_heads, feature_map=self.feature_map,
            tie_feature_map_qk=self.tie_feature_map_qk, output_norm=self.output_norm, norm_q=self.norm_q,
            norm_k=self.norm_k, norm_eps=self.norm_eps, chunk_size=self.chunk_size,
        )
