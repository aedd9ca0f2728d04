"""Weight initialisation, a separate pass over a built model.

Linear and embedding weights ~ N(0, init_std²), biases 0, norms 1. With
``depth_scaled_init`` the output projections of every block (the mixer's ``o_proj``, FFN down)
use std = init_std / sqrt(2 · N_compute), N_compute being the number of blocks on the
unrolled computation path (MeSH Appendix B; GPT-2's residual scaling applied to the
unrolled depth, since a shared block adds to the residual stream once per iteration).
Per-iteration adapters start with B_t = 0 (:mod:`looplm.modules.lora`). Topologies,
streams, halting rules and step embeddings initialise their own parameters
(``reset_parameters``; :meth:`looplm.model.LoopLM.reset_parameters` calls them after this pass).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import nn

from looplm.modules.block import Block
from looplm.modules.lora import IterationLoRA
from looplm.modules.moe import ExpertLinear
from looplm.modules.norm import RMSNorm


def output_projection_std(init_std: float, unrolled_depth: int, depth_scaled: bool) -> float:
    """init_std / sqrt(2 · N_compute) (MeSH Appendix B) or init_std."""
    return init_std / math.sqrt(2 * max(unrolled_depth, 1)) if depth_scaled else init_std


def init_weights(model: nn.Module, blocks: Iterable[Block], std: float, output_std: float) -> None:
    """Every module of ``model`` as above (std ``std``), then the output projections of
    ``blocks`` with ``output_std`` (:func:`output_projection_std`)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, IterationLoRA):
            module.reset_parameters()  # A_t Gaussian, B_t zero: the core starts tied
        elif isinstance(module, ExpertLinear):  # E linear weights of a mixture of experts
            nn.init.normal_(module.weight, std=std)
    for block in blocks:
        for mixer in block.mixer_layers():
            nn.init.normal_(mixer.o_proj.weight, std=output_std)  # every mixer names its W_O o_proj
        for ffn in block.ffn_layers():
            nn.init.normal_(ffn.down.weight, std=output_std)
