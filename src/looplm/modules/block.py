"""Pre-norm transformer block: norm -> token mixer -> residual -> norm -> FFN -> residual.

With ``model.head_loop`` a block carries a grown loop (``looplm.growth``): K_l extra
passes after the attention sub-layer, of the selected heads only (SGT Eq. 6), or of the
whole block (Block Loop). K_l = 0 (the start of training, or a block never grown) runs
the plain block."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from looplm.growth.config import HeadLoopConfig
from looplm.growth.structure import GrownLoop, LoopedState
from looplm.mixers import MixerConfig, MixerContext, MixerState
from looplm.mixers.attention import SoftmaxAttention
from looplm.modules.mlp import build_mlp
from looplm.modules.norm import build_norm
from looplm.modules.shape import BlockShape


class Block(nn.Module):
    """Sequential: x + mix(n1(x)), then + ffn(n2(·)). Parallel (GPT-NeoX):
    x + mix(n1(x)) + ffn(n2(x)).

    ``shape``: widths and block options (``ModelConfig.block_shape``). ``mixers``: one
    spec, or one per loop iteration (a loop-level hybrid). One layer is
    built per parameter group (``MixerConfig.parameter_group``) and held in ``attn`` (a
    ModuleList when there are several); each iteration runs its spec's view of it.
    """

    def __init__(self, cfg: BlockShape, mixers: Sequence[MixerConfig], head_loop: Optional[HeadLoopConfig] = None):
        super().__init__()
        mixers = tuple(mixers)
        self.parallel_residual = cfg.parallel_residual
        self.attn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        owners: dict = {}
        for spec in mixers:
            if spec.parameter_group() not in owners:
                owners[spec.parameter_group()] = spec.build(cfg)
        # named as in fla's layers, whatever the mixer
        self.attn = next(iter(owners.values())) if len(owners) == 1 else nn.ModuleList(owners.values())
        self.per_iteration = [spec.view(owners[spec.parameter_group()]) for spec in mixers]  # views, not registered
        self.ffn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = build_mlp(cfg.mlp, cfg.d_model, cfg.ffn_hidden, cfg.bias)
        # SGT: only blocks with softmax attention can loop (their entropy picks them)
        growable = head_loop is not None and any(spec.is_softmax for spec in mixers)
        self.loop = GrownLoop(head_loop.kind, cfg.n_heads) if growable else None

    def mixer_layers(self) -> list[nn.Module]:
        """The distinct mixer layers (parameter owners) of this block."""
        return list(self.attn) if isinstance(self.attn, nn.ModuleList) else [self.attn]

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[MixerState] = None, iteration: int = 0
    ) -> tuple[torch.Tensor, MixerState]:
        """x: [B, T, d] -> ([B, T, d], the mixer's state after these positions; a
        :class:`LoopedState` when the block runs extra passes)."""
        mixer = self.per_iteration[iteration if len(self.per_iteration) > 1 else 0]
        depth = self.loop.depth if self.loop is not None and isinstance(mixer, SoftmaxAttention) else 0
        if depth == 0:
            return self._layer(x, ctx, state, mixer)
        main, passes = (state.main, state.passes) if isinstance(state, LoopedState) else (None, (None,) * depth)
        location, new_passes = ctx.location, []
        if self.loop.kind == "block":  # Block Loop: the whole block re-applied K_l times
            x, main = self._layer(x, ctx, main, mixer)
            for k in range(depth):
                ctx.location = (f"{location[0]}.loop{k + 1}", location[1])  # probes: one entry per pass
                x, pass_state = self._layer(x, ctx, passes[k], mixer)
                new_passes.append(pass_state)
        else:
            mixed, main = mixer(self.attn_norm(x), ctx, main)
            x = x + mixed  # H^(0) = H_post, Eq. (3)
            heads, weights = self.loop.heads, self.loop.head_weights
            for k in range(depth):
                ctx.location = (f"{location[0]}.loop{k + 1}", location[1])
                update, pass_state = mixer.forward_heads(self.attn_norm(x), ctx, heads, weights, passes[k])
                x = x + update  # Eq. (6): H^(k) = H^(k-1) + Σ_{i∈S} Attn^(i)(H^(k-1))
                new_passes.append(pass_state)
            x = x + self.ffn(self.ffn_norm(x))  # the FFN reads H^(K_l) (Alg. 1 line 13)
        ctx.location = location
        return x, LoopedState(main, tuple(new_passes))

    def _layer(self, x: torch.Tensor, ctx: MixerContext, state: Optional[MixerState], mixer) -> tuple[torch.Tensor, MixerState]:
        mixed, state = mixer(self.attn_norm(x), ctx, state)
        if self.parallel_residual:
            return x + mixed + self.ffn(self.ffn_norm(x)), state
        x = x + mixed
        return x + self.ffn(self.ffn_norm(x)), state
