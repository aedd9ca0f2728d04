"""DeltaNet (Schlag et al. 2021; Yang et al. 2024), and the body it shares with Gated
DeltaNet and KDA.

The layer is flash-linear-attention's ``fla.layers.DeltaNet`` (parameter names included,
so weights move between the two): q/k/v projections, causal short convolutions with SiLU,
L2-normalised q and k, β_t = σ(W_b x_t), the delta rule

    S_t = (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t / √d_k     (LT2 Table 1)

then a per-head RMSNorm of o_t (gated by SiLU(W_g x_t) when ``use_gate``) and o_proj.
Training runs the chunkwise op, decoding one token the recurrent step, both carrying
the recurrent matrix and the short-convolution inputs in :class:`DeltaRuleState`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost
from looplm.config_base import check
from looplm.ops.backend import log_backend, use_fla
from looplm.mixers.base import MixerContext
from looplm.mixers.linear import (
    LinearMixerConfig,
    ProjectedMixer,
    check_conv,
    check_expands_positive,
    init_dt_bias,
    is_whole,
    linear_core_cost,
    whole,
)
from looplm.modules.norm import GatedRMSNorm, RMSNorm, gate_activation, l2_scaled, rms_scaled
from looplm.modules.shape import BlockShape
from looplm.modules.short_conv import causal_conv1d
from looplm.ops.delta import chunk_delta_rule, chunk_size_rule, delta_rule_update, fla_delta_rule, recurrent_delta_rule

#: fla's ``l2norm`` epsilon: x / sqrt(Σ x² + L2_EPS)
L2_EPS = 1e-6


@dataclasses.dataclass
class DeltaRuleState:
    """Decoding state of a delta-rule mixer after ``length`` positions.

    recurrent: S [B, H, K, V] (float32). conv: the last conv_size - 1 inputs of the q, k
    and v short convolutions, concatenated on channels ([B, 2·H·K + H·V, conv_size - 1]),
    None without them. Shapes never change from step to step, so a static cache can copy a
    step's state into its buffers in place.
    """

    recurrent: torch.Tensor
    conv: Optional[torch.Tensor]
    length: int

    def crop(self, length: int) -> "DeltaRuleState":
        if length >= self.length:
            return self
        raise ValueError(
            f"cannot crop a delta-rule mixer's state from {self.length} to {length} positions: its recurrent "
            f"matrix S summarises every position and cannot be rewound; run the first {length} positions again"
        )

    def select(self, index: torch.Tensor) -> "DeltaRuleState":
        conv = None if self.conv is None else self.conv[index]
        return DeltaRuleState(self.recurrent[index], conv, self.length)

    def static(self, capacity: int) -> "DeltaRuleState":
        """Already static: S and the conv windows keep their shapes at any length (a static
        cache copies each step's values into these tensors, :mod:`looplm.cache`)."""
        return self


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim (fla's ``l2norm``)."""
    return x * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps).to(x.dtype)


class DeltaRuleMixer(ProjectedMixer):
    """What DeltaNet, Gated DeltaNet and KDA share: q/k/v projections and short
    convolutions, L2-normalised q and k, β, the delta-rule op on the right backend, the
    per-head output norm and o_proj. A subclass sets ``kind``, ``o_norm`` and ``g_proj``
    (None: ungated norm), and overrides :meth:`log_decay` (log α_t; None for α = 1).

    Shapes: x [B, T, hidden]; q, k [B, T, H, head_k_dim]; v, o [B, T, H, head_v_dim].
    """

    kind = "delta_rule"  # the mixer kind, for the backend log
    op_family = "delta"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        use_beta: bool = True,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        chunk_size: int = 64,
    ):
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_heads * head_k_dim, num_heads * head_v_dim
        self.allow_neg_eigval, self.chunk_size = allow_neg_eigval, chunk_size
        widths = {"q": self.key_dim, "k": self.key_dim, "v": self.value_dim}
        self.add_projections(hidden_size, widths)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False) if use_beta else None
        self.add_short_convs(widths, use_short_conv, conv_size, conv_bias, activation="silu")
        self.g_proj: Optional[nn.Module] = None
        self.o_norm: nn.Module = RMSNorm(head_v_dim)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def log_decay(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """log α_t from x [B, T, hidden]: None (α = 1), [B, T, H] or [B, T, H, K], float32."""
        return None

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[DeltaRuleState] = None
    ) -> tuple[torch.Tensor, DeltaRuleState]:
        """x: [B, T, hidden] -> ([B, T, hidden], state after these T positions)."""
        B, T, _ = x.shape
        H = self.num_heads
        valid = ctx.new_valid if ctx.padded else None  # [B, T]; False on left padding
        if T == 1 and state is not None:
            return self.step(x, valid, state)
        previous = None if state is None or state.conv is None else split_conv_states(state.conv, H, self.key_dim)
        (q, k, v), conv = self.project(x, previous, valid)
        if not self.use_short_conv:  # the convolutions apply SiLU themselves
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q = l2_normalize(q.view(B, T, H, self.head_k_dim))
        k = l2_normalize(k.view(B, T, H, self.head_k_dim))
        v = v.view(B, T, H, self.head_v_dim)
        if self.b_proj is not None:
            beta = torch.sigmoid(self.b_proj(x).float())  # [B, T, H]
        else:
            beta = x.new_ones(B, T, H, dtype=torch.float32)
        if self.allow_neg_eigval:
            beta = 2 * beta  # β ∈ (0, 2): negative eigenvalues of I - β k kᵀ (Grazzi et al. 2025)
        log_alpha = self.log_decay(x)
        if valid is not None:  # padding leaves S unchanged: β = 0 (no write), log α = 0 (no decay)
            beta = beta * valid[..., None]
            if log_alpha is not None:
                log_alpha = log_alpha * valid.view(B, T, *([1] * (log_alpha.dim() - 2)))
        o, S = self._delta_rule(q, k, v, beta, log_alpha, None if state is None else state.recurrent)
        if self.g_proj is not None:
            o = self.o_norm(o, self.g_proj(x).view(B, T, H, self.head_v_dim))
        else:
            o = self.o_norm(o)
        length = T if state is None else state.length + T
        conv = fuse_conv_states(*conv, heads=H) if conv else None
        if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self.decode_weights()  # a prefill: have the decoding step's fused weights ready (cached)
        return self.o_proj(o.reshape(B, T, self.value_dim)), DeltaRuleState(S, conv, length)

    # ------------------------------------------------------------------ decoding step
    def gate_rows(self) -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        """The rows the decoding step's fused input projection computes after q, k, v: (name,
        weight [n, hidden], bias [n] or None). Here β's (b) and the output gate's (g)."""
        rows = []
        if self.b_proj is not None:
            rows.append(("b", self.b_proj.weight, None))
        if isinstance(self.g_proj, nn.Linear):
            rows.append(("g", self.g_proj.weight, None))
        return rows

    def derived_gates(self) -> dict[str, torch.Tensor]:
        """Constants the decoding step's gates derive from parameters (cached with the fused weights)."""
        return {}

    def step_gates(
        self, parts: dict[str, torch.Tensor], derived: dict[str, torch.Tensor]
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(α_t: None, [B, H] or [B, H, K]; β_t [B, H] or None for β = 1; the output gate's input
        [B, value_dim] or None) of one position from the rows :meth:`gate_rows` named."""
        beta = torch.sigmoid(parts["b"].float()) if "b" in parts else None
        return None, beta, parts.get("g")

    def decode_weights(self) -> dict[str, Any]:
        """q, k, v and :meth:`gate_rows` as one projection (``proj`` [N, hidden], ``bias`` [N] or
        None; ``gate_layout``: the gate rows' (name, width)), the three short convolutions as
        one (``conv`` [C, 1, K], ``conv_bias``), o_proj with the output norm's weight folded in
        (``o_proj``, on the PyTorch path) and :meth:`derived_gates`; cached while the
        parameters are unchanged (:meth:`derived`)."""

        fla = use_fla(self.o_proj.weight)

        def build() -> dict[str, Any]:
            gate_rows = self.gate_rows()
            H = self.num_heads
            qk = interleave_heads(self.q_proj.weight, self.k_proj.weight, H)
            rows = [(qk, None), (self.v_proj.weight, None)]
            rows += [(w, b) for _, w, b in gate_rows]
            bias = None
            if any(b is not None for _, b in rows):
                bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b.to(w.dtype) for w, b in rows])
            out = {"proj": torch.cat([w for w, _ in rows]), "bias": bias, **self.derived_gates(),
                   "gate_layout": [(name, w.shape[0]) for name, w, _ in gate_rows]}
            if not fla:  # (fla's path runs the fused norm kernel and o_proj)
                # o_proj(w ⊙ √V·x) = (o_proj · diag(√V·w per head)) x: the output norm's weight folded in
                norm_weight = self.o_norm.weight.repeat(H) * self.head_v_dim**0.5
                out["o_proj"] = self.o_proj.weight * norm_weight.to(self.o_proj.weight.dtype)
            if self.use_short_conv:
                q, k, v = self.q_conv1d, self.k_conv1d, self.v_conv1d
                out["conv"] = torch.cat([interleave_heads(q.weight, k.weight, H), v.weight])
                if q.bias is not None:
                    out["conv_bias"] = torch.cat([interleave_heads(q.bias, k.bias, H), v.bias])
                else:
                    out["conv_bias"] = None
            return out

        return self.derived(build, tag=fla)

    def step(
        self, x: torch.Tensor, valid: Optional[torch.Tensor], state: DeltaRuleState
    ) -> tuple[torch.Tensor, DeltaRuleState]:
        """One new position: x [B, 1, hidden], valid [B, 1] or None -> ([B, 1, hidden], state).

        The same layer as :meth:`forward`, in few operators: one input projection for q, k, v
        and the gates, one short convolution over the three streams, q and k L2-normalised
        together, :func:`~looplm.ops.delta.delta_rule_update`, the output norm and o_proj.
        """
        B = x.shape[0]
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        weights = self.decode_weights()
        h = F.linear(x[:, 0], weights["proj"], weights["bias"])  # [B, N]: q, k, v, then the gate rows
        C = 2 * self.key_dim + self.value_dim
        qkv = h[:, :C]
        if valid is not None:  # a padding position is convolved as zeros
            qkv = qkv * valid.to(qkv.dtype)
        if self.use_short_conv:
            y, conv = causal_conv1d(qkv[:, None], weights["conv"], weights["conv_bias"], state.conv, "silu")
            qkv = y[:, 0]
        else:
            qkv, conv = F.silu(qkv), None
        names, widths = zip(*weights["gate_layout"]) if weights["gate_layout"] else ((), ())
        parts = dict(zip(names, h[:, C:].split(list(widths), dim=-1)))
        qk = qkv[:, : 2 * self.key_dim].view(B, H, 2, K)  # q_h, k_h side by side per head
        v = qkv[:, 2 * self.key_dim :].view(B, H, V)
        fused = None
        if valid is None and use_fla(x, gated=self.gated_op()):
            fused = self.fla_fused_step(qk, v, parts, state.recurrent)
        if fused is not None:
            log_backend(self.kind, "fla")
            (o, S), gate = fused, parts.get("g")
        else:
            o, S, gate = self._step_rule(x, qk, v, parts, weights, valid, state.recurrent)
        if use_fla(x):  # fla's fused gated norm kernel
            o = o.to(x.dtype)
            o = self.o_norm(o, self.output_gate(gate).view(B, H, V)) if self.g_proj is not None else self.o_norm(o)
            return self.o_proj(o.reshape(B, 1, self.value_dim)), DeltaRuleState(S, conv, state.length + 1)
        # o_norm with its weight (and √V) folded into o_proj's columns (``o_proj`` of decode_weights)
        o = rms_scaled(o.float(), self.o_norm.eps)
        if self.g_proj is not None:
            o = o * gate_activation(self.output_gate(gate).view(B, H, V).float(), self.o_norm.activation)
        out = F.linear(o.to(x.dtype).reshape(B, 1, self.value_dim), weights["o_proj"])
        return out, DeltaRuleState(S, conv, state.length + 1)

    def _step_rule(self, x, qk, v, parts, weights, valid, recurrent):
        """The gates, L2 norms and delta rule of one position computed here (PyTorch, or fla's
        kernel on the prepared inputs): qk [B, H, 2, K] raw, v [B, H, V] -> (o [B, H, V], S_t,
        the output gate's input)."""
        B, H, _, K = qk.shape
        alpha, beta, gate = self.step_gates(parts, weights)
        if self.allow_neg_eigval:
            beta = 2 * (x.new_ones(B, H, dtype=torch.float32) if beta is None else beta)
        if valid is not None:  # padding leaves S unchanged: β = 0, α = 1
            beta = valid.float() if beta is None else beta * valid
            if alpha is not None:
                alpha = torch.where(valid.view(B, *([1] * (alpha.dim() - 1))), alpha, 1.0)
        # fla's l2norm, x / sqrt(Σ x² + eps), for q and k in one division; q and k stay views
        # with one stride over (B, H), as the batched products take them
        qk = l2_scaled(qk, L2_EPS)
        q, k = qk[:, :, 0], qk[:, :, 1]
        if use_fla(x, gated=self.gated_op()):
            log_backend(self.kind, "fla")
            log_alpha = None if alpha is None else alpha.log()
            beta = x.new_ones(B, H, dtype=torch.float32) if beta is None else beta
            o, S = fla_delta_rule(q[:, None], k[:, None], v[:, None], beta[:, None],
                                  None if log_alpha is None else log_alpha[:, None], recurrent, step=True)
            return o[:, 0], S, gate
        log_backend(self.kind, "torch")
        o, S = delta_rule_update(q, k, v, beta, alpha, recurrent, K**-0.5)
        return o, S, gate

    def fla_fused_step(
        self, qk: torch.Tensor, v: torch.Tensor, parts: dict[str, torch.Tensor], recurrent: torch.Tensor
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """On CUDA, one fla kernel that also applies the L2 norms and the gates to the raw
        inputs (qk [B, H, 2, K], v [B, H, V], the gate rows): (o [B, H, V], S_t), or None
        where this kind has no such kernel (then :meth:`_step_rule` prepares them)."""
        return None

    def output_gate(self, gate: torch.Tensor) -> torch.Tensor:
        """The output norm's gate input [B, value_dim] from its fused row (KDA: up-projected)."""
        return gate

    def _delta_rule(self, q, k, v, beta, log_alpha, initial_state) -> tuple[torch.Tensor, torch.Tensor]:
        """fla's Triton kernels on CUDA when installed, else looplm's ops: the recurrent
        step for one new position, the chunkwise form otherwise. Returns (o, S_T)."""
        step = q.shape[1] == 1
        # fla's chunk_delta_rule has no float32 kernel; float32 DeltaNet training stays on torch
        if use_fla(q, gated=self.gated_op()) and (step or log_alpha is not None or q.dtype != torch.float32):
            log_backend(self.kind, "fla")
            return fla_delta_rule(q, k, v, beta, log_alpha, initial_state, step)
        log_backend(self.kind, "torch")
        if step:
            return recurrent_delta_rule(q, k, v, beta, log_alpha, initial_state=initial_state, output_final_state=True)
        return chunk_delta_rule(
            q, k, v, beta, log_alpha, initial_state=initial_state, output_final_state=True, chunk_size=self.chunk_size
        )

    def flop_cost(self, call: Call) -> Cost:
        return (self.children_flop_cost(call, self.num_heads, self.head_v_dim)
                + linear_core_cost(call, self.num_heads, self.head_k_dim, self.head_v_dim, self.chunk_size, delta=True))


class MambaDecayDeltaRule(DeltaRuleMixer):
    """The delta-rule layers sized per head with Mamba2's Δ-discretised decay (GDN, KDA):
    q, k num_heads × head_dim, v num_heads × head_dim·expand_v; log α_t = -exp(A_log) ·
    softplus(· + dt_bias), with A ~ U(A_min, 16) per head and dt_bias from
    :func:`~looplm.mixers.linear.init_dt_bias`."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, expand_v: float, use_short_conv: bool,
                 conv_size: int, conv_bias: bool, allow_neg_eigval: bool, chunk_size: int):
        super().__init__(
            hidden_size, num_heads, head_dim, whole(head_dim * expand_v, "expand_v"),
            use_short_conv=use_short_conv, conv_size=conv_size, conv_bias=conv_bias,
            allow_neg_eigval=allow_neg_eigval, chunk_size=chunk_size,
        )

    def add_decay(self, A_min: float, dt_channels: int) -> None:
        """A_log (A ~ U(A_min, 16), one per head) and dt_bias (``dt_channels`` of them)."""
        self.A_log = nn.Parameter(torch.empty(self.num_heads).uniform_(A_min, 16).log())
        self.dt_bias = nn.Parameter(init_dt_bias(dt_channels))


def interleave_heads(q: torch.Tensor, k: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (dim 0) of q and k, each [H·K, ...], as [q_0, k_0, q_1, k_1, ...] per head
    ([2·H·K, ...]): the decoding step's fused layout, in which normalised q and k come out
    of one division as [B, H, 2, K] and each is a (B·H)-batch for ``bmm`` without a copy."""
    return torch.stack([q.unflatten(0, (heads, -1)), k.unflatten(0, (heads, -1))], dim=1).flatten(0, 2)


def fuse_conv_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """The q, k, v short-convolution states ([B, C, K-1] each) as the one tensor
    :class:`DeltaRuleState` keeps: q and k interleaved per head (as :func:`interleave_heads`), then v."""
    qk = torch.stack([q.unflatten(1, (heads, -1)), k.unflatten(1, (heads, -1))], dim=2).flatten(1, 3)
    return torch.cat([qk, v], dim=1)


def split_conv_states(conv: torch.Tensor, heads: int, key_dim: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`fuse_conv_states`: (q, k, v) states from the fused one."""
    qk = conv[:, : 2 * key_dim].unflatten(1, (heads, 2, -1))  # [B, H, 2, K, conv_size - 1]
    return qk[:, :, 0].flatten(1, 2), qk[:, :, 1].flatten(1, 2), conv[:, 2 * key_dim :]


class DeltaNet(DeltaRuleMixer):
    """fla's ``DeltaNet`` layer (qk_activation silu, qk_norm l2).

    key_dim = hidden·expand_k and value_dim = hidden·expand_v are split over num_heads;
    ``use_beta=False`` fixes β = 1; ``use_gate`` gates the output norm with SiLU(g_proj(x));
    ``allow_neg_eigval`` doubles β.
    """

    kind = "deltanet"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 4,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        use_beta: bool = True,
        use_gate: bool = False,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
    ):
        key_dim = whole(hidden_size * expand_k, "expand_k")
        value_dim = whole(hidden_size * expand_v, "expand_v")
        if key_dim % num_heads or value_dim % num_heads:
            raise ValueError(f"key_dim={key_dim} and value_dim={value_dim} must be divisible by num_heads={num_heads}")
        super().__init__(
            hidden_size, num_heads, key_dim // num_heads, value_dim // num_heads, use_beta=use_beta,
            use_short_conv=use_short_conv, conv_size=conv_size, conv_bias=conv_bias,
            allow_neg_eigval=allow_neg_eigval, chunk_size=chunk_size,
        )
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation="swish")
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps)


# ----------------------------------------------------------------------------- configs
@dataclasses.dataclass(frozen=True)
class DeltaRuleConfig(LinearMixerConfig):
    """Fields every delta-rule mixer config shares; the chunk size is the delta-rule op's
    (a power of two >= 16)."""

    use_short_conv: bool = True
    conv_size: int = 4
    conv_bias: bool = False
    allow_neg_eigval: bool = False

    chunk_rule = staticmethod(chunk_size_rule)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_conv(self.conv_size)

    def common(self) -> dict:
        """The layer keyword arguments these shared fields give."""
        return dict(use_short_conv=self.use_short_conv, conv_size=self.conv_size, conv_bias=self.conv_bias,
                    allow_neg_eigval=self.allow_neg_eigval, norm_eps=self.norm_eps, chunk_size=self.chunk_size)


@dataclasses.dataclass(frozen=True)
class DeltaNetConfig(DeltaRuleConfig):
    """DeltaNet (fla ``DeltaNet``): key/value widths d_model·expand_k / d_model·expand_v."""

    kind: str = "deltanet"
    expand_k: float = 1.0
    expand_v: float = 1.0
    use_beta: bool = True
    use_gate: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_expands_positive(expand_k=self.expand_k, expand_v=self.expand_v)

    def build(self, shape: BlockShape) -> nn.Module:
        heads = self.heads(shape)
        self.check_expands(shape, heads, expand_k=self.expand_k, expand_v=self.expand_v)
        return DeltaNet(shape.d_model, heads, self.expand_k, self.expand_v, use_beta=self.use_beta,
                        use_gate=self.use_gate, **self.common())


@dataclasses.dataclass(frozen=True)
class HeadSizedDeltaRuleConfig(DeltaRuleConfig):
    """The delta-rule kinds sized per head (GDN, KDA): ``head_dim`` null: d_model /
    num_heads; value heads head_dim·expand_v wide."""

    head_dim: Optional[int] = None
    expand_v: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.head_dim is None or self.head_dim >= 1, "model.mixer.head_dim", self.head_dim,
              "null (d_model / num_heads) or an integer >= 1")
        check_expands_positive(expand_v=self.expand_v)

    def head_shape(self, shape: BlockShape) -> tuple[int, int]:
        """(num_heads, head_dim) on ``shape``, checked."""
        heads = self.heads(shape)
        check(self.head_dim is not None or shape.d_model % heads == 0, "model.mixer.num_heads", heads,
              f"a divisor of d_model={shape.d_model}, or set head_dim")
        head_dim = self.head_dim or shape.d_model // heads
        width = head_dim * self.expand_v
        check(is_whole(width), "model.mixer.expand_v", self.expand_v,
              f"a factor making head_dim·expand_v = {width:g} whole")
        return heads, head_dim
