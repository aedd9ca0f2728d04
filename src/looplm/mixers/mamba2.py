"""Mamba2 (Dao & Gu 2024, SSD): a selective state space with a scalar decay per head,

    S_t = α_t S_{t-1} + B_t (Δ_t x_t)ᵀ,   α_t = exp(Δ_t A_h),   y_t = S_tᵀ C_t + D_h x_t     (LT2 Table 1)

with Δ_t = softplus(dt_t + dt_bias) and A_h = -exp(A_log_h), i.e. the decay op with
q = C, k = B, v = Δ·x, log α = Δ·A and scale 1 (state S [B, H, state_size, head_dim],
the transpose of mamba_ssm's [B, H, head_dim, state_size]). The layer is
flash-linear-attention's ``fla.layers.Mamba2`` (parameter names included; its PyTorch
path ``torch_forward``): in_proj -> [z | x B C | dt], a SiLU causal convolution over
x, B, C, the SSD recurrence, the D skip, an RMSNorm gated by SiLU(z) (per group) and
out_proj.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost, children_cost
from looplm.config_base import ConfigError, check
from looplm.mixers.base import MixerContext
from looplm.mixers.linear import init_dt_bias, linear_core_cost
from looplm.mixers.linear_attention import DecayMixer, DecayMixerConfig, DecayState, repeat_kv
from looplm.modules.norm import GatedRMSNorm
from looplm.modules.shape import BlockShape
from looplm.modules.short_conv import ShortConvolution


class Mamba2(DecayMixer):
    """fla's ``Mamba2`` layer.

    intermediate = expand·hidden = num_heads·head_dim (num_heads None: inferred from
    head_dim, as fla). B and C have n_groups groups of state_size; head h reads group
    h // (num_heads / n_groups) (mamba_ssm's kernels and fla's decode path). ``D_has_hdim``:
    D per channel instead of per head. ``rmsnorm``: y ← RMSNorm_group(y·SiLU(z))
    (``norm_before_gate=False``, fla's default), else y ← y·SiLU(z). dt_min / dt_max /
    dt_init_floor / A_init_range: the initialisation of dt_bias and A_log.
    Shapes: x [B, T, hidden] -> [B, T, hidden]; state S [B, H, state_size, head_dim].
    """

    kind = "mamba2"
    decay_gate = "head"

    def __init__(
        self,
        hidden_size: int,
        num_heads: Optional[int] = None,
        head_dim: int = 64,
        state_size: int = 128,
        expand: int = 2,
        n_groups: int = 1,
        conv_kernel: int = 4,
        use_conv_bias: bool = True,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        use_bias: bool = False,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
    ):
        super().__init__()
        self.hidden_size, self.expand = hidden_size, expand
        self.intermediate_size = int(expand * hidden_size)
        if self.intermediate_size % head_dim:
            raise ValueError(
                f"expand * hidden_size ({self.intermediate_size}) must be divisible by head_dim ({head_dim})"
            )
        inferred = self.intermediate_size // head_dim
        if num_heads not in (None, 0, inferred):
            raise ValueError(f"num_heads * head_dim ({num_heads * head_dim}) must equal expand * hidden_size "
                             f"({self.intermediate_size})")
        self.num_heads, self.head_dim, self.ssm_state_size, self.n_groups = inferred, head_dim, state_size, n_groups
        if self.num_heads % n_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by n_groups ({n_groups})")
        self.D_has_hdim, self.rmsnorm, self.chunk_size = D_has_hdim, rmsnorm, chunk_size
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + self.num_heads, bias=use_bias)
        self.conv1d = ShortConvolution(self.conv_dim, conv_kernel, bias=use_conv_bias, activation="silu")
        self.dt_bias = nn.Parameter(init_dt_bias(self.num_heads, dt_min, dt_max, dt_init_floor))
        self.dt_bias._no_weight_decay = True
        self.A_log = nn.Parameter(torch.empty(self.num_heads).uniform_(*A_init_range).log())
        self.A_log._no_weight_decay = True
        self.norm = (
            GatedRMSNorm(self.intermediate_size, eps=norm_eps, norm_before_gate=norm_before_gate,
                         group_size=self.intermediate_size // n_groups)
            if rmsnorm else None
        )
        self.D = nn.Parameter(torch.ones(self.intermediate_size if D_has_hdim else self.num_heads))
        self.D._no_weight_decay = True
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias)

    @property
    def head_k_dim(self) -> int:
        """The op's key width: the state size N (C_t, B_t are its queries and keys)."""
        return self.ssm_state_size

    @property
    def head_v_dim(self) -> int:
        """The op's value width: the head dim P."""
        return self.head_dim

    @property
    def o_proj(self) -> nn.Linear:
        """W_O under looplm's name (the depth-scaled init finds it); stored as fla's out_proj."""
        return self.out_proj

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[DecayState] = None
    ) -> tuple[torch.Tensor, DecayState]:
        """x: [B, T, hidden] -> ([B, T, hidden], state after these T positions)."""
        B, T, _ = x.shape
        H, P, N, G, I = self.num_heads, self.head_dim, self.ssm_state_size, self.n_groups, self.intermediate_size
        valid = ctx.new_valid if ctx.padded else None  # [B, T]; False on left padding
        z, xBC, dt = self.in_proj(x).split([I, self.conv_dim, H], dim=-1)
        xBC, conv = self.conv1d(xBC, None if state is None else state.conv[0], valid)
        xs, Bm, Cm = xBC.split([I, G * N, G * N], dim=-1)
        xs = xs.view(B, T, H, P)
        Bm = repeat_kv(Bm.view(B, T, G, N), H // G)  # [B, T, H, N]
        Cm = repeat_kv(Cm.view(B, T, G, N), H // G)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # Δ_t: [B, T, H]
        log_alpha = dt * -self.A_log.float().exp()  # log α_t = Δ_t A_h
        k, log_alpha = self.mask_padding(valid, Bm, log_alpha)
        v = (xs * dt[..., None]).to(xs.dtype)  # Δ_t x_t
        y, S = self.decay(Cm, k, v, log_alpha, 1.0, None if state is None else state.recurrent)
        D = self.D.view(H, P) if self.D_has_hdim else self.D[:, None]
        y = (y + xs * D).reshape(B, T, I)  # D skip
        y = self.norm(y, z) if self.norm is not None else y * F.silu(z)
        return self.out_proj(y.to(x.dtype)), DecayState(S, (conv,), ctx.valid.shape[1])

    def flop_cost(self, call: Call) -> Cost:
        """The children once per position (the gated norm spans every head) and the SSD core."""
        return children_cost(self, call) + linear_core_cost(call, self.num_heads, self.ssm_state_size, self.head_dim,
                                                            self.chunk_size, delta=False)


@dataclasses.dataclass(frozen=True)
class Mamba2Config(DecayMixerConfig):
    """Mamba2 (fla ``Mamba2``). Width expand·d_model split into heads of ``head_dim``;
    ``head_dim`` null: into num_heads (null: the model's n_heads) heads. B, C: n_groups
    groups of ``state_size``."""

    kind: str = "mamba2"
    head_dim: Optional[int] = None
    state_size: int = 128
    expand: int = 2
    n_groups: int = 1
    conv_kernel: int = 4
    use_conv_bias: bool = True
    A_init_range: tuple[float, ...] = (1.0, 16.0)
    D_has_hdim: bool = False
    rmsnorm: bool = True
    norm_before_gate: bool = False
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    use_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.head_dim is None or self.head_dim >= 1, "model.mixer.head_dim", self.head_dim,
              "null (expand·d_model / num_heads) or an integer >= 1")
        check(self.state_size >= 1, "model.mixer.state_size", self.state_size, "an integer >= 1")
        check(self.expand >= 1, "model.mixer.expand", self.expand, "an integer >= 1")
        check(self.n_groups >= 1, "model.mixer.n_groups", self.n_groups, "an integer >= 1")
        check(self.conv_kernel >= 1, "model.mixer.conv_kernel", self.conv_kernel, "an integer >= 1")
        low_high = tuple(self.A_init_range)
        check(len(low_high) == 2 and 0 < low_high[0] <= low_high[1], "model.mixer.A_init_range",
              list(low_high), "two numbers 0 < low <= high (A ~ U(low, high))")
        check(0 < self.dt_min <= self.dt_max, "model.mixer.dt_min", self.dt_min,
              f"a number in (0, dt_max={self.dt_max}]")
        check(self.dt_init_floor > 0, "model.mixer.dt_init_floor", self.dt_init_floor, "a number > 0")

    def head_shape(self, shape: BlockShape) -> tuple[int, int]:
        """(num_heads, head_dim) on ``shape``, checked."""
        width = self.expand * shape.d_model
        if self.head_dim is None:
            heads = self.heads(shape)
            if width % heads:
                raise ConfigError("model.mixer.num_heads", heads,
                                  f"a divisor of expand·d_model={width}, or set head_dim")
            head_dim = width // heads
        else:
            if width % self.head_dim:
                raise ConfigError("model.mixer.head_dim", self.head_dim, f"a divisor of expand·d_model={width}")
            heads, head_dim = width // self.head_dim, self.head_dim
            check(self.num_heads in (None, heads), "model.mixer.num_heads", self.num_heads,
                  f"null or {heads} (= expand·d_model / head_dim)")
        check(heads % self.n_groups == 0, "model.mixer.n_groups", self.n_groups, f"a divisor of num_heads={heads}")
        return heads, head_dim

    def build(self, shape: BlockShape) -> nn.Module:
        heads, head_dim = self.head_shape(shape)
        return Mamba2(
            shape.d_model, heads, head_dim, self.state_size, self.expand, n_groups=self.n_groups,
            conv_kernel=self.conv_kernel, use_conv_bias=self.use_conv_bias, A_init_range=tuple(self.A_init_range),
            D_has_hdim=self.D_has_hdim, rmsnorm=self.rmsnorm, norm_before_gate=self.norm_before_gate,
            dt_min=self.dt_min, dt_max=self.dt_max, dt_init_floor=self.dt_init_floor, use_bias=self.use_bias,
            norm_eps=self.norm_eps, chunk_size=self.chunk_size,
        )
