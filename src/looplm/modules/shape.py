"""The widths and block options every layer of a block is sized by.

``ModelConfig.block_shape`` hands this down, so mixers and blocks (lower layers) are built
from plain numbers and never import the model's config.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from looplm.modules.moe import MoEConfig


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """d_model: the residual width. n_heads / kv_heads: query and key/value heads of
    softmax attention (and the default head count of the linear mixers). rotary_dim:
    rotary channels per head (0 with learned positions); rope_theta: their base. bias:
    biases on projections. norm, norm_eps, mlp, ffn_hidden, parallel_residual: the block
    around the mixer (GPT-NeoX or LLaMA style). norm_placement: ``pre`` normalises each
    sub-layer's input; ``sandwich`` also its output before the residual add (Ouro). moe:
    the FFN as a mixture of experts (:mod:`looplm.modules.moe`), None for a dense FFN."""

    d_model: int
    n_heads: int
    kv_heads: int
    rotary_dim: int
    rope_theta: float
    bias: bool
    norm: Literal["rmsnorm", "layernorm"] = "layernorm"
    norm_eps: float = 1e-5
    mlp: Literal["gelu", "swiglu"] = "gelu"
    ffn_hidden: int = 0
    parallel_residual: bool = False
    norm_placement: Literal["pre", "sandwich"] = "pre"
    moe: Optional[MoEConfig] = None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def norms_per_block(self) -> int:
        """Norm layers in one block: input norms of the two sub-layers, plus their output
        norms under ``sandwich``."""
        return 4 if self.norm_placement == "sandwich" else 2
