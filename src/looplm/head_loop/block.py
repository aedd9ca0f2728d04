"""Blocks that grow extra passes during training (sparse-growing-transformer.txt §4).

:func:`grown_block_type` picks, under ``model.head_loop`` and for a block with softmax
attention (its entropy is what picks layers), the grown block of the configured kind,
which :func:`~looplm.modules.block.build_block` builds in place of the plain one: the
plain block, the same parameters under the same names, plus its grown structure
``head_loop`` (K_l and the head weights, written by the trainer,
:mod:`looplm.head_loop.training`). K_l = 0 (the start of training, a block never grown)
runs the plain block.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from looplm.accounting.cost import Call, Cost, module_cost
from looplm.head_loop.attention import head_pass_cost, head_subset_attention, pass_weights, permute_heads
from looplm.head_loop.structure import GrownLoop, LoopedState
from looplm.mixers import MixerConfig, MixerContext, MixerState
from looplm.mixers.attention import SoftmaxAttention
from looplm.head_loop.config import HeadLoopConfig
from looplm.modules.block import Block
from looplm.modules.shape import BlockShape


def extra_pass_location(location: tuple[str, int], k: int) -> tuple[str, int]:
    """Where extra pass k >= 1 of the block running at ``location`` records: (``<block>.loop<k>``, pass)."""
    block, slot = location
    return f"{block}.loop{k}", slot


class GrownBlock(Block):
    """A block with K_l extra passes (``head_loop.depth``) after its first pass; a kind
    says what the passes are. Only iterations whose mixer is softmax attention loop (the
    passes slice its projections); in a loop-level hybrid the others run the plain block.
    With K_l > 0 its decoding state is a :class:`LoopedState`: each pass attends over the
    keys of its own input H^(k-1), so each has its own slot."""

    def __init__(self, cfg: BlockShape, mixers: Sequence[MixerConfig], ffn_sets: int = 1):
        super().__init__(cfg, mixers, ffn_sets)
        self.head_loop = GrownLoop(cfg.n_heads, cfg.kv_heads, cfg.head_dim)
        self.softmax_at = [isinstance(view, SoftmaxAttention) for view in self.per_iteration]  # per iteration

    def softmax_layers(self) -> list[SoftmaxAttention]:
        """The block's softmax attention layers (parameter owners): the ones its passes slice."""
        return [layer for layer in self.mixer_layers() if isinstance(layer, SoftmaxAttention)]

    def extra_passes(self, iteration: int = 0) -> int:
        """K_l at loop iteration ``iteration``: 0 where that iteration's mixer does not loop."""
        softmax = self.softmax_at[iteration if len(self.softmax_at) > 1 else 0]
        return self.head_loop.depth if softmax else 0

    def forward(
        self, x: torch.Tensor, ctx: MixerContext, state: Optional[MixerState] = None, iteration: int = 0
    ) -> tuple[torch.Tensor, MixerState]:
        """x: [B, T, d] -> ([B, T, d], the mixer's state, or with K_l > 0 a :class:`LoopedState`)."""
        depth = self.extra_passes(iteration)
        if depth == 0:
            return super().forward(x, ctx, state, iteration)
        mixer = self.mixer_at(iteration)
        main, passes = (None, (None,) * depth) if state is None else (state.main, state.passes)
        x, main = self._first_pass(x, ctx, mixer, main)
        location, new_passes = ctx.location, []
        weights = self._pass_weights(mixer)
        for k, pass_state in enumerate(passes):
            ctx.at(*extra_pass_location(location, k + 1))  # probes: one entry per pass
            x, pass_state = self._extra_pass(x, ctx, mixer, pass_state, weights)
            new_passes.append(pass_state)
        ctx.at(*location)
        return self._last(x), LoopedState(main, tuple(new_passes))

    def _first_pass(self, x, ctx: MixerContext, mixer: SoftmaxAttention, state) -> tuple[torch.Tensor, MixerState]:
        raise NotImplementedError

    def _pass_weights(self, mixer: SoftmaxAttention):
        """What every extra pass of one forward reads (taken once, shared by the K_l passes)."""
        return None

    def _extra_pass(self, x, ctx: MixerContext, mixer: SoftmaxAttention, state, weights) -> tuple[torch.Tensor, MixerState]:
        raise NotImplementedError

    def _last(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        """Checkpoints written before the structure was named ``head_loop`` hold it as
        ``<block>.loop._extra_state``: read them under the current name."""
        old = prefix + "loop._extra_state"
        if old in state_dict:
            state_dict[prefix + "head_loop._extra_state"] = state_dict.pop(old)
        super()._load_from_state_dict(state_dict, prefix, *args)


class HeadLoopBlock(GrownBlock):
    """``kind: heads``: after the attention sub-layer, K_l pre-norm passes of the selected
    heads S only (Eq. 6), then the FFN on H^(K_l).

    Its heads may be stored permuted (:meth:`arrange_heads`, ``head_loop.order``): the
    attention probabilities it records for probes are put back in the original head order."""

    def forward(self, x, ctx, state=None, iteration=0):
        out = super().forward(x, ctx, state, iteration)
        loop = self.head_loop
        if ctx.attentions is not None and loop.order != tuple(range(loop.n_heads)):  # probes: original order
            location = ctx.location
            looped = [loop.order[p] for p in loop.slots]  # the heads a pass computes, in slot order
            by_pass = sorted(range(len(looped)), key=looped.__getitem__)
            ascending = {location: loop.slot_of}  # [B, H, T, S] recorded in slot order
            ascending.update({extra_pass_location(location, k + 1): by_pass
                              for k in range(self.extra_passes(iteration))})
            for key, index in ascending.items():
                if key in ctx.attentions:
                    probs = ctx.attentions[key]
                    ctx.attentions[key] = probs.index_select(1, torch.tensor(index, device=probs.device))
        return out

    def arrange_heads(self, first: Sequence[int], optimizer: Optional[torch.optim.Optimizer] = None) -> bool:
        """Permute the heads in storage so that the heads ``first`` (original numbering)
        take consecutive slots (:func:`_grouped_order`) and the extra passes read narrow
        views; nothing moves when they already do. A re-parameterisation: the parameters,
        their gradients and ``optimizer``'s state move together
        (:func:`~looplm.head_loop.attention.permute_heads`), so the block computes the same
        function and trains on as before (FSDP2 shards included). Returns whether
        anything moved."""
        loop = self.head_loop
        chosen, g = set(first), loop.n_heads // loop.n_kv_heads
        slots = [p for p, h in enumerate(loop.order) if h in chosen]
        if not self.softmax_layers() or (_consecutive(slots) and _consecutive(sorted({p // g for p in slots}))):
            return False  # nothing to slice (NSA, DSA), or already narrow
        order = _grouped_order(chosen, loop.n_heads, loop.n_kv_heads)
        if order == loop.order:
            return False
        slot = {h: p for p, h in enumerate(loop.order)}
        for layer in self.softmax_layers():
            permute_heads(layer, [slot[h] for h in order], optimizer)
        loop.set_order(order)
        return True

    def _first_pass(self, x, ctx, mixer, state):
        mixed, state = mixer(self.attn_norm(x), ctx, state)
        return x + mixed, state  # H^(0) = H_post, Eq. (3)

    def _pass_weights(self, mixer):
        return pass_weights(mixer, self.head_loop)

    def _extra_pass(self, x, ctx, mixer, state, weights):
        # Eq. (6): H^(k) = H^(k-1) + Σ_{i∈S} Attn^(i)(H^(k-1))
        return head_subset_attention(mixer, self.attn_norm(x), ctx, self.head_loop, weights, state, residual=x)

    def _last(self, x):
        return self._ffn_sublayer(x, self.ffn, None)  # the FFN reads H^(K_l) (Alg. 1 line 13)

    def flop_cost(self, call: Call) -> Cost:
        """The block plus K_l passes of norm -> S's slice of the attention -> residual (Eq. 6)
        before the FFN (K_l and the heads S with w_i > 0 from ``self.head_loop``)."""
        attention, ffn = self.sublayer_costs(call)
        iteration = max(call.iteration, 0)
        depth = self.extra_passes(iteration)
        if depth == 0:  # not grown, or this iteration's mixer does not loop
            return attention + ffn
        d = self.attn_norm.weight.shape[0]
        head_pass = head_pass_cost(self.mixer_at(iteration), call, len(self.head_loop.heads),
                                   len(self.head_loop.kv_slots))
        passes = module_cost(self.attn_norm, call) + head_pass + Cost(residual=call.rows * d)
        return attention + passes.scale(depth) + ffn


def _consecutive(values: Sequence[int]) -> bool:
    return list(values) == list(range(values[0], values[0] + len(values))) if values else False


def _grouped_order(first: set[int], n_heads: int, n_kv_heads: int) -> tuple[int, ...]:
    """A head order (slot -> original head) that keeps each kv head's group of g = H / H_kv
    query heads in consecutive slots and puts the heads ``first`` in consecutive slots
    (ascending): under MHA first; under GQA the groups they fill, with at most two groups
    they share with other heads at either end (ending with / starting with theirs). With
    more shared groups ``first`` cannot be consecutive: its groups come first, each
    starting with its heads (the passes then gather the query rows)."""
    g = n_heads // n_kv_heads

    def members(j: int, leading: bool) -> list[int]:  # group j's heads, those of ``first`` leading or trailing
        return sorted(range(j * g, j * g + g), key=lambda h: ((h in first) != leading, h))

    touched = [j for j in range(n_kv_heads) if first & set(range(j * g, j * g + g))]
    full = [j for j in touched if set(range(j * g, j * g + g)) <= first]
    shared = [j for j in touched if j not in full]
    rest = [j for j in range(n_kv_heads) if j not in touched]
    if len(shared) == 2:
        groups = [members(shared[0], False)] + [members(j, True) for j in full] + [members(shared[1], True)]
    else:
        groups = [members(j, True) for j in full + shared]
    return tuple(h for group in groups + [members(j, True) for j in rest] for h in group)


class BlockLoopBlock(GrownBlock):
    """``kind: block``: Block Loop, the whole block re-applied K_l times (App. D.1)."""

    def _first_pass(self, x, ctx, mixer, state):
        return self._layer(x, ctx, state, mixer)

    def _extra_pass(self, x, ctx, mixer, state, weights):
        return self._layer(x, ctx, state, mixer)

    def flop_cost(self, call: Call) -> Cost:
        """Block Loop: 1 + K_l applications of the whole block (K_l from ``self.head_loop``)."""
        attention, ffn = self.sublayer_costs(call)
        return (attention + ffn).scale(1 + self.extra_passes(max(call.iteration, 0)))


#: ``model.head_loop.kind`` -> the grown block it builds
GROWN_BLOCKS = {"heads": HeadLoopBlock, "block": BlockLoopBlock}


def grown_block_type(head_loop: Optional[HeadLoopConfig], mixers: Sequence[MixerConfig]) -> Optional[type[GrownBlock]]:
    """The grown block a block with ``mixers`` becomes under ``model.head_loop`` (for
    :func:`looplm.modules.block.build_block`): the kind's, where some of them compute
    softmax attention (its entropy is what picks layers); None: the block stays plain."""
    if head_loop is None or not any(spec.is_softmax for spec in mixers):
        return None
    return GROWN_BLOCKS[head_loop.kind]


def grown_blocks(model: nn.Module) -> dict[int, GrownBlock]:
    """{index in ``model.blocks()``: block} of the blocks that can grow."""
    return {l: b for l, b in enumerate(model.blocks()) if isinstance(b, GrownBlock)}


def grown_structure(model: nn.Module) -> dict[str, dict]:
    """{block name: {depth, heads, weights}} for every block whose loop depth is > 0."""
    names = model.cfg.structure.block_labels
    return {names[l]: b.head_loop.describe() for l, b in grown_blocks(model).items() if b.head_loop.depth > 0}
