"""Stage 1, linear pre-alignment (lt2.txt §5): "with F = ∅, we align each GDN block to the
corresponding teacher attention output via an MSE loss on the residual stream".

The teacher runs once (no gradients) with a forward hook on every block's mixer, which
records, per call, the mixer's input (the teacher's normalised residual stream entering
that block at that loop iteration), its output (what attention adds to the stream) and
the forward's :class:`~looplm.mixers.MixerContext`. Each student mixer then runs on the
same input and is pulled towards the same output:

    L_align = mean over (block ℓ, iteration τ) of ‖GDN_ℓ(x_ℓ^(τ)) − Attn_ℓ(x_ℓ^(τ))‖² / (L·d)

so a weight-shared core block is aligned at every loop iteration it runs. The student
shares the teacher's norms, so x_ℓ^(τ) is also what the student's own norm would produce
on the teacher's stream."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from looplm.distill.student import block_paths
from looplm.mixers import MixerContext
from looplm.mixers.attention import SoftmaxAttention
from looplm.model import LoopLM


@dataclasses.dataclass
class MixerCall:
    """One teacher mixer call: block ``path``, loop ``iteration``, input x [B, L, d] and
    output y [B, L, d] (both detached), and the forward's context."""

    path: str
    iteration: int
    x: torch.Tensor
    y: torch.Tensor
    ctx: MixerContext


@torch.no_grad()
def record_teacher(teacher: LoopLM, input_ids: torch.Tensor) -> list[MixerCall]:
    """Every mixer call of one teacher forward on ``input_ids`` [B, L], in call order."""
    calls: list[MixerCall] = []
    handles = []
    for paths in block_paths(teacher.cfg):
        for path in paths:
            block = teacher.get_submodule(path)

            def hook(module, args, output, path=path):
                x, ctx = args[0], args[1]
                calls.append(MixerCall(path, ctx.location[1], x.detach(), output[0].detach(), ctx))

            handles.append(block.attn.register_forward_hook(hook))
    try:
        teacher(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def alignment_loss(student: LoopLM, calls: list[MixerCall]) -> torch.Tensor:
    """Mean MSE of the student's linear mixers against the recorded teacher attention
    outputs, over every (block, iteration) call of a block the student runs linearly."""
    terms = []
    for call in calls:
        block = student.get_submodule(call.path)
        if isinstance(block.attn, SoftmaxAttention):  # a kept block (F) is the teacher's own
            continue
        mixer = block.mixer_at(call.iteration)
        ctx = dataclasses.replace(call.ctx, losses={}, attentions=None)
        y, _ = mixer(call.x, ctx, None)
        terms.append(F.mse_loss(y.float(), call.y.float()))
    if not terms:
        raise ValueError("no teacher mixer calls were recorded: the teacher has no blocks")
    return torch.stack(terms).mean()
