"""One forward per batch, plus what the model's output does not carry, through hooks.

The model already returns the loop states h^(0..T), the topology's record (MeSH router
weights, combination coefficients) and, on request, the softmax probabilities per
(block, iteration). Probes that need more (every block's input and output along the
unrolled computation, the value vectors of softmax attention, the embeddings, the
final-norm input) attach forward hooks to the model's own modules for the duration of
one forward (litgpt / lingua style): no model code is edited or re-implemented.

Hooks read the (block, iteration) being run from the :class:`~looplm.mixers.MixerContext`
the model passes to every block (``ctx.location``), so shared core blocks, which run once
per iteration, are told apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch
from torch import nn

from looplm.mixers import MixerContext
from looplm.mixers.attention import SoftmaxAttention
from looplm.model import LoopLM, ModelOutput

Location = tuple[str, int]  # (block name "prelude.j" / "core.j" / "coda.j", iteration)


@dataclasses.dataclass
class BlockCall:
    """One block application along the unrolled computation: input and output [B, T, d]."""

    location: Location
    input: torch.Tensor
    output: torch.Tensor


@dataclasses.dataclass
class Capture:
    """Everything one forward of one batch gave the probes.

    inputs, targets: [B, T]. output: the model's :class:`ModelOutput`. blocks: every block
    call in execution order (prelude, core × iterations, coda), when asked. values: value
    vectors [B, H, S, D] of softmax-attention blocks per location (grouped-query heads
    repeated to H), when asked. h_emb: the (scaled) token embeddings entering the model
    [B, T, d]; h_out: the coda output entering the final norm. ctx: the forward's mixer
    context of the coda (None without a coda), for re-running it on other states (logit lens)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    output: ModelOutput
    blocks: list[BlockCall]
    values: dict[Location, torch.Tensor]
    h_emb: Optional[torch.Tensor]
    h_out: Optional[torch.Tensor]
    ctx: Optional[MixerContext]

    def block_outputs(self, location: Location) -> torch.Tensor:
        for call in self.blocks:
            if call.location == location:
                return call.output
        raise KeyError(location)


@contextlib.contextmanager
def _hooks(model: LoopLM, capture: dict, *, blocks: bool, values: bool) -> Iterator[None]:
    handles = []
    current: dict[str, Location] = {}

    def before_block(module: nn.Module, args) -> None:
        if args[1].location[0].startswith("coda"):  # full-resolution positions and masks of the coda
            capture["ctx"] = args[1]

    def before_attention(module: nn.Module, args) -> None:
        current["location"] = args[1].location  # a grown SGT pass runs under its own location

    def after_block(module: nn.Module, args, output) -> None:
        capture["blocks"].append(BlockCall(args[1].location, args[0].detach(), output[0].detach()))

    def after_embed(module: nn.Module, args, output) -> None:
        scale = model.cfg.d_model ** 0.5 if model.cfg.embed_scale else 1.0  # the model's h_emb
        capture["h_emb"] = output.detach() * scale

    def before_norm(module: nn.Module, args) -> None:
        capture["h_out"] = args[0].detach()

    def after_qkv(layer: SoftmaxAttention, block: nn.Module):
        def hook(module: nn.Module, args, output) -> None:
            B, T, _ = output.shape
            H, Hkv, D = layer.n_heads, layer.n_kv_heads, layer.head_dim
            v = output[..., (H + Hkv) * D :].reshape(B, T, Hkv, D).transpose(1, 2)  # [B, H_kv, T, D]
            if Hkv != H:
                v = v.repeat_interleave(H // Hkv, dim=1)
            loop = getattr(block, "head_loop", None)
            if loop is not None and loop.order != tuple(range(H)):  # SGT-arranged heads: the original order
                v = v.index_select(1, torch.tensor(loop.slot_of, device=v.device))
            capture["values"][current["location"]] = v.detach()

        return hook

    try:
        handles.append(model.embed.register_forward_hook(after_embed))
        handles.append(model.norm.register_forward_pre_hook(before_norm))
        for block in model.blocks():
            handles.append(block.register_forward_pre_hook(before_block))
            if blocks:
                handles.append(block.register_forward_hook(after_block))
            if values:
                for layer in block.mixer_layers():
                    if isinstance(layer, SoftmaxAttention):
                        handles.append(layer.register_forward_pre_hook(before_attention))
                        handles.append(layer.qkv.register_forward_hook(after_qkv(layer, block)))
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def capture_forward(
    model: LoopLM,
    inputs: torch.Tensor,
    targets: Optional[torch.Tensor] = None,
    *,
    states: bool = False,
    attentions: bool = False,
    blocks: bool = False,
    values: bool = False,
) -> Capture:
    """Run the model once on ``inputs`` [B, T] and collect what was asked for."""
    found: dict = {"blocks": [], "values": {}, "h_emb": None, "h_out": None, "ctx": None}
    with _hooks(model, found, blocks=blocks, values=values):
        output = model(inputs, targets, output_states=states, output_attentions=attentions)
    if found["ctx"] is not None:
        found["ctx"].attentions = None  # later coda re-runs must not add to output.attentions
    return Capture(inputs=inputs, targets=targets, output=output, **found)


@torch.no_grad()
def read_out(model: LoopLM, capture: Capture, h: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of state h [B, T, d] read through the model's own coda blocks, final
    norm and head (:meth:`LoopLM.read_out`), with the captured forward's positions and
    masks (the logit lens)."""
    return model.read_out(h, capture.ctx)
