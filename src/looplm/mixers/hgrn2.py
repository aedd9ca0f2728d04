"""HGRN2 (Qin et al. 2024): gated linear RNN with state expansion, the forget gate tied
to the input gate,

    S_t = Diag(α_t) S_{t-1} + (1 - α_t) i_tᵀ,   α_t = σ(f_t),   o_t = S_tᵀ SiLU(q_t) / √K     (LT2 Table 1)

i.e. the GLA op with k_t = 1 - α_t. The layer is flash-linear-attention's
``fla.layers.HGRN2Attention`` (parameter names included): q/f/i projections (optional
short convolutions, no activation), the GLA op with fla's default scale 1/√K, an RMSNorm
over the whole output (``g_norm``) and o_proj.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Cost
from looplm.config_base import ConfigError, check
from looplm.mixers.base import MixerContext
from looplm.mixers.linear import check_conv, linear_core_cost
from looplm.mixers.linear_attention import DecayMixer, DecayMixerConfig, DecayState
from looplm.modules.norm import RMSNorm
from looplm.modules.shape import BlockShape


class HGRN2Attention(DecayMixer):
    """fla's ``HGRN2Attention`` layer.

    ``expand_ratio`` (the state expansion, head_f_dim = K) sets num_heads = hidden /
    expand_ratio; when it is None, ``num_heads`` sets expand_ratio = hidden / num_heads
    (fla's rule). q and f: num_heads × expand_ratio; i: hidden, head_i_dim = hidden /
    num_heads = V. fla's HGRN2 model passes a per-layer lower bound on α; the layer alone
    (as here) has none. Shapes: x [B, T, hidden] -> [B, T, hidden]; state S [B, H, K, V].
    """

    kind = "hgrn2"
    decay_gate = "channel"

    def __init__(
        self,
        hidden_size: int,
        num_heads: Optional[int] = None,
        expand_ratio: Optional[int] = 128,
        use_short_conv: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
    ):
        super().__init__()
        if expand_ratio is not None:
            num_heads = hidden_size // expand_ratio
        elif num_heads is not None:
            expand_ratio = hidden_size // num_heads
        else:
            raise ValueError("one of expand_ratio or num_heads must be given")
        if num_heads < 1 or hidden_size % num_heads:
            raise ValueError(f"num_heads={num_heads} must be a divisor of hidden_size={hidden_size}")
        self.hidden_size, self.num_heads, self.expand_ratio = hidden_size, num_heads, expand_ratio
        self.forget_dim, self.input_dim = num_heads * expand_ratio, hidden_size
        self.head_f_dim, self.head_i_dim = expand_ratio, hidden_size // num_heads
        self.chunk_size = chunk_size
        widths = {"q": self.forget_dim, "f": self.forget_dim, "i": self.input_dim}
        self.add_projections(hidden_size, widths)
        self.add_short_convs(widths, use_short_conv, conv_size, conv_bias, activation=None)
        self.g_norm = RMSNorm(hidden_size, eps=norm_eps)
        self.o_proj = nn.Linear(self.input_dim, hidden_size, bias=False)

    @property
    def head_k_dim(self) -> int:
        """The op's key width: the forget gate's per head (q, k and log α are that wide)."""
        return self.head_f_dim

    @property
    def head_v_dim(self) -> int:
        """The op's value width: the input's per head."""
        return self.head_i_dim

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[DecayState] = None
    ) -> tuple[torch.Tensor, DecayState]:
        """x: [B, T, hidden] -> ([B, T, hidden], state after these T positions)."""
        B, T, _ = x.shape
        H = self.num_heads
        valid = ctx.new_valid if ctx.padded else None  # [B, T]; False on left padding
        (q, f, i), new_conv = self.project(x, None if state is None else state.conv, valid)
        q = F.silu(q).view(B, T, H, self.head_f_dim)
        log_alpha = F.logsigmoid(f.float()).view(B, T, H, self.head_f_dim)  # log α_t
        k = (-torch.expm1(log_alpha)).to(x.dtype)  # k_t = 1 - α_t
        k, log_alpha = self.mask_padding(valid, k, log_alpha)
        o, S = self.decay(q, k, i.view(B, T, H, self.head_i_dim), log_alpha, None,
                          None if state is None else state.recurrent)
        o = self.g_norm(o.reshape(B, T, self.input_dim))
        return self.o_proj(o), DecayState(S, new_conv, ctx.valid.shape[1])

    def flop_cost(self, call: Call) -> Cost:
        return (self.children_flop_cost(call, self.num_heads, self.head_i_dim)
                + linear_core_cost(call, self.num_heads, self.head_f_dim, self.head_i_dim, self.chunk_size,
                                    delta=False))


@dataclasses.dataclass(frozen=True)
class HGRN2Config(DecayMixerConfig):
    """HGRN2 (fla ``HGRN2Attention``). ``expand_ratio`` null: d_model / num_heads (fla's
    rule when only num_heads is given); else num_heads = d_model / expand_ratio (fla's
    default expand_ratio is 128)."""

    kind: str = "hgrn2"
    expand_ratio: Optional[int] = None
    use_short_conv: bool = False
    conv_size: int = 4
    conv_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.expand_ratio is None or self.expand_ratio >= 1, "model.mixer.expand_ratio", self.expand_ratio,
              "null (d_model / num_heads) or an integer >= 1")
        check(self.expand_ratio is None or self.num_heads is None, "model.mixer.num_heads", self.num_heads,
              "null when expand_ratio is set (num_heads = d_model / expand_ratio)")
        check_conv(self.conv_size)

    def build(self, shape: BlockShape) -> nn.Module:
        if self.expand_ratio is not None:
            if shape.d_model % self.expand_ratio:
                raise ConfigError("model.mixer.expand_ratio", self.expand_ratio,
                                  f"a divisor of d_model={shape.d_model}")
            heads = None
        else:
            heads = self.heads(shape)
            if shape.d_model % heads:
                raise ConfigError("model.mixer.num_heads", heads, f"a divisor of d_model={shape.d_model}")
        return HGRN2Attention(
            shape.d_model, heads, self.expand_ratio, use_short_conv=self.use_short_conv, conv_size=self.conv_size,
            conv_bias=self.conv_bias, norm_eps=self.norm_eps, chunk_size=self.chunk_size,
        )
