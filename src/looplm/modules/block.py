"""Transformer block: norm -> token mixer -> residual -> norm -> FFN -> residual.

The norm placement (``BlockShape.norm_placement``) is a value of the block: ``pre``
normalises each sub-layer's input; ``sandwich`` also normalises its output before the
residual add (Ouro, modeling_ouro.py ``OuroDecoderLayer``). Under ``pre`` the output
norms are ``nn.Identity`` (no parameters, no state-dict entries, the same numbers).

The FFN is dense (``BlockShape.mlp``) or a mixture of experts (``BlockShape.moe``), one
set of experts or one per loop iteration (``ffn_sets``; :meth:`Block.ffn_at`).

SGT's grown passes (``model.head_loop``) extend this block from outside
(:mod:`looplm.head_loop.block`): :func:`build_block` builds either. Per-iteration LoRA
(``model.lora``, :mod:`looplm.modules.lora`) is a per-iteration view of a core block's
linears: :meth:`Block.mixer_at` and :meth:`Block.ffn_at` return iteration t's."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost, module_cost
from looplm.mixers import MixerConfig, MixerContext, MixerState
from looplm.modules.lora import BlockLoRA, LoRAConfig
from looplm.modules.mlp import GeluMLP, SwiGLU, build_mlp
from looplm.modules.moe import build_moe
from looplm.modules.norm import build_norm
from looplm.modules.shape import BlockShape


def output_norm(cfg: BlockShape) -> nn.Module:
    """A sub-layer's output norm: ``nn.Identity`` under ``pre``; under ``sandwich`` a norm
    of the block's kind applied to the sub-layer's output before the residual add."""
    if cfg.norm_placement == "sandwich":
        return build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
    return nn.Identity()


class Block(nn.Module):
    """Sequential: x + m1(mix(n1(x))), then + m2(ffn(n2(·))). Parallel (GPT-NeoX):
    x + m1(mix(n1(x))) + m2(ffn(n2(x))). m1, m2 (``attn_out_norm``, ``ffn_out_norm``) are
    the identity under ``norm_placement: pre`` and norms under ``sandwich``.

    ``shape``: widths and block options (``ModelConfig.block_shape``). ``mixers``: one
    spec, or one per loop iteration (a loop-level hybrid). One layer is
    built per parameter group (``MixerConfig.parameter_group``) and held in ``attn`` (a
    ModuleList when there are several); each iteration runs its spec's view of it.
    ``lora`` (a core block of a model with ``model.lora.rank`` > 0): the config and the
    trained iterations T; the block then holds ``lora`` (:class:`BlockLoRA`) and iteration
    t's mixer and FFN add B_t A_t x to their linears. Otherwise ``lora`` is None.
    ``ffn_sets``: expert sets of a mixture-of-experts FFN (one per loop iteration, or 1).
    """

    def __init__(self, cfg: BlockShape, mixers: Sequence[MixerConfig], ffn_sets: int = 1,
                 lora: Optional[tuple[LoRAConfig, int]] = None):
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
        self.ffn = build_ffn(cfg, ffn_sets)
        self.attn_out_norm = output_norm(cfg)
        self.ffn_out_norm = output_norm(cfg)
        # x + FFN(x) as one call of a dense FFN (no output norm between them)
        self.ffn_adds_residual = isinstance(self.ffn, (GeluMLP, SwiGLU)) and isinstance(self.ffn_out_norm, nn.Identity)
        self.lora: Optional[BlockLoRA] = None
        self.ffn_per_iteration: list[nn.Module] = []  # views, not registered; empty: the FFN itself
        if lora is not None and lora[0].enabled:
            self.lora = BlockLoRA(lora[0], lora[1], self.mixer_layers(), self.ffn)
            groups = list(owners)
            self.per_iteration = self.lora.mixer_views(self.per_iteration,
                                                       [groups.index(s.parameter_group()) for s in mixers])
            self.ffn_per_iteration = self.lora.ffn_views(self.ffn)

    def mixer_layers(self) -> list[nn.Module]:
        """The distinct mixer layers (parameter owners) of this block."""
        return list(self.attn) if isinstance(self.attn, nn.ModuleList) else [self.attn]

    def mixer_at(self, iteration: int) -> nn.Module:
        """The mixer view that runs at loop iteration ``iteration`` (the only one outside a
        loop-level hybrid)."""
        return self.per_iteration[iteration if len(self.per_iteration) > 1 else 0]

    def ffn_layers(self) -> list[nn.Module]:
        """The distinct FFNs of this block: one, or one expert set per loop iteration."""
        return list(self.ffn) if isinstance(self.ffn, nn.ModuleList) else [self.ffn]

    def ffn_at(self, iteration: int) -> nn.Module:
        """The FFN that runs at loop iteration ``iteration``: its per-iteration LoRA view, or
        that iteration's expert set, or the FFN itself."""
        views = self.ffn_per_iteration
        if views:
            return views[iteration if len(views) > 1 else 0]
        return self.ffn[iteration] if isinstance(self.ffn, nn.ModuleList) else self.ffn

    def variant(self, iteration: int) -> int:
        """The loop iteration whose behaviour this block shows at ``iteration``: itself where
        the block has per-iteration mixers, adapters or experts, else 0 (every iteration runs
        the same function, so a compiled pass of one serves all, :mod:`looplm.modules.region`)."""
        per_iteration = (len(self.per_iteration) > 1 or len(self.ffn_per_iteration) > 1
                         or isinstance(self.ffn, nn.ModuleList))
        return iteration if per_iteration else 0

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[MixerState] = None, iteration: int = 0
    ) -> tuple[torch.Tensor, MixerState]:
        """x: [B, T, d] -> ([B, T, d], the mixer's state after these positions)."""
        return self._layer(x, ctx, state, self.mixer_at(iteration), self.ffn_at(iteration))

    def _layer(self, x: torch.Tensor, ctx: MixerContext, state: Optional[MixerState], mixer,
               ffn: Optional[nn.Module] = None) -> tuple[torch.Tensor, MixerState]:
        ffn = self.ffn if ffn is None else ffn
        mixed, state = mixer(self.attn_norm(x), ctx, state)
        mixed = self.attn_out_norm(mixed)
        if self.parallel_residual:
            return x + mixed + self.ffn_out_norm(ffn(self.ffn_norm(x), ctx)), state
        return self._ffn_sublayer(x + mixed, ffn, ctx), state

    def _ffn_sublayer(self, x: torch.Tensor, ffn: nn.Module, ctx: Optional[MixerContext]) -> torch.Tensor:
        """x + out_norm(FFN(norm(x))); a dense FFN adds x in its down projection (one GEMM)."""
        if self.ffn_adds_residual:
            return ffn(self.ffn_norm(x), ctx, residual=x)
        return x + self.ffn_out_norm(ffn(self.ffn_norm(x), ctx))

    def sublayer_costs(self, call: Call) -> tuple[Cost, Cost]:
        """norm -> mixer (this iteration's view) -> output norm -> residual, and norm -> FFN ->
        output norm -> residual (the output norms cost nothing under ``norm_placement: pre``)."""
        d = self.attn_norm.weight.shape[0]
        mixer, ffn = self.mixer_at(max(call.iteration, 0)), self.ffn_at(max(call.iteration, 0))
        attention = (module_cost(self.attn_norm, call) + module_cost(mixer, call) + module_cost(self.attn_out_norm, call)
                     + Cost(residual=call.rows * d))
        ffn = (module_cost(self.ffn_norm, call) + module_cost(ffn, call) + module_cost(self.ffn_out_norm, call)
               + Cost(residual=call.rows * d))
        return attention, ffn

    def flop_cost(self, call: Call) -> Cost:
        """One application at ``call.iteration`` (the prelude and coda run as iteration 0)."""
        attention, ffn = self.sublayer_costs(call)
        return attention + ffn


def build_ffn(shape: BlockShape, sets: int = 1) -> nn.Module:
    """The block's FFN: dense (GELU or SwiGLU), or ``shape.moe``'s experts, ``sets`` of them
    (one per loop iteration) when they are per iteration."""
    if shape.moe is None:
        return build_mlp(shape.mlp, shape.d_model, shape.ffn_hidden, shape.bias)
    return build_moe(shape.moe, shape.d_model, shape.ffn_hidden, shape.mlp, sets)


def build_block(shape: BlockShape, mixers: Sequence[MixerConfig], grown: Optional[type[Block]] = None,
                ffn_sets: int = 1, lora: Optional[tuple[LoRAConfig, int]] = None) -> Block:
    """The block of one position with ``mixers`` (one, or one per loop iteration): the plain
    :class:`Block`, or ``grown``, a subclass an axis that grows blocks picked for it (the
    same parameters under the same names plus its extra state: SGT's head loop,
    :func:`looplm.head_loop.block.grown_block_type`). ``ffn_sets``: expert sets of a
    mixture-of-experts FFN. ``lora``: per-iteration adapters (config, T) for a core block
    (never with a grown block: the config refuses it)."""
    if lora is not None and lora[0].enabled:
        return Block(shape, mixers, ffn_sets, lora)
    return (Block if grown is None else grown)(shape, mixers, ffn_sets)
