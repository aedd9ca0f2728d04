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
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.config_base import check
from looplm.mixers.backend import log_backend, use_fla
from looplm.mixers.base import MixerContext
from looplm.mixers.linear import (
    LinearMixerConfig,
    ProjectedMixer,
    check_conv,
    check_expands_positive,
    init_dt_bias,
    is_whole,
    whole,
)
from looplm.modules.norm import GatedRMSNorm, RMSNorm
from looplm.modules.shape import BlockShape
from looplm.ops.delta import chunk_delta_rule, chunk_size_rule, recurrent_delta_rule


@dataclasses.dataclass
class DeltaRuleState:
    """Decoding state of a delta-rule mixer after ``length`` positions.

    recurrent: S [B, H, K, V] (float32). conv: the last conv_size - 1 inputs of the q, k
    and v short convolutions ([B, H·K or H·V, conv_size - 1] each), None without them.
    """

    recurrent: torch.Tensor
    conv: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    length: int

    def crop(self, length: int) -> "DeltaRuleState":
        if length >= self.length:
            return self
        raise ValueError(
            f"cannot crop a delta-rule mixer's state from {self.length} to {length} positions: its recurrent "
            f"matrix S summarises every position and cannot be rewound; run the first {length} positions again"
        )

    def select(self, index: torch.Tensor) -> "DeltaRuleState":
        conv = None if self.conv is None else tuple(c[index] for c in self.conv)
        return DeltaRuleState(self.recurrent[index], conv, self.length)

    def static(self, capacity: int) -> "DeltaRuleState":
        """Already static: S and the conv windows keep their shapes at any length (a static
        cache copies each step's values into these tensors, :mod:`looplm.cache`)."""
        return self


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
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
        (q, k, v), conv = self.project(x, None if state is None else state.conv, valid)
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
        return self.o_proj(o.reshape(B, T, self.value_dim)), DeltaRuleState(S, conv or None, length)

    def _delta_rule(self, q, k, v, beta, log_alpha, initial_state) -> tuple[torch.Tensor, torch.Tensor]:
        """fla's Triton kernels on CUDA when installed, else looplm's ops: the recurrent
        step for one new position, the chunkwise form otherwise. Returns (o, S_T)."""
        step = q.shape[1] == 1
        # fla's chunk_delta_rule has no float32 kernel; float32 DeltaNet training stays on torch
        if use_fla(q, gated=log_alpha is not None) and (step or log_alpha is not None or q.dtype != torch.float32):
            log_backend(self.kind, "fla")
            return fla_delta_rule(q, k, v, beta, log_alpha, initial_state, step)
        log_backend(self.kind, "torch")
        if step:
            return recurrent_delta_rule(q, k, v, beta, log_alpha, initial_state=initial_state, output_final_state=True)
        return chunk_delta_rule(
            q, k, v, beta, log_alpha, initial_state=initial_state, output_final_state=True, chunk_size=self.chunk_size
        )


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


def fla_delta_rule(q, k, v, beta, log_alpha, initial_state, step: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same op through flash-linear-attention (CUDA): q, k (normalised) [B, T, H, K],
    v [B, T, H, V], beta [B, T, H], log_alpha None / [B, T, H] / [B, T, H, K] (fla's ``g``),
    initial_state [B, H, K, V] float32 or None. Returns (o [B, T, H, V], S_T float32)."""
    kwargs = dict(beta=beta.to(q.dtype), initial_state=initial_state, output_final_state=True)
    if log_alpha is None:
        from fla.ops.delta_rule import chunk_delta_rule as chunk
        from fla.ops.delta_rule import fused_recurrent_delta_rule as recurrent
    elif log_alpha.dim() == 3:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
        from fla.ops.gated_delta_rule import (
            fused_recurrent_gated_delta_rule as recurrent,
        )

        kwargs["g"] = log_alpha
    else:
        from fla.ops.kda import chunk_kda as chunk
        from fla.ops.kda import fused_recurrent_kda as recurrent

        kwargs["g"] = log_alpha
    o, S = (recurrent if step else chunk)(q=q, k=k, v=v, **kwargs)
    return o, S.float()


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
