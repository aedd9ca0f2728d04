"""The execution plan: the module calls of one full forward, in order, loops unrolled.

The recurrence is not re-implemented here: each axis object describes its own part, and
the plan reads those descriptions as ``LoopLM._recur`` runs them. The streams list the
core passes of a macro step (``streams.schedule``: what each pass reads, with or without
gradient) and say whether the topology folds the update in (``streams.uses_topology``);
the resolution says at what resolution iteration t runs (``resolution.identity(t)``, its
schedule); the halting rule says whether it evaluates a module every step
(``halting.evaluates``) and whether it reads the logits (``halting.reads_logits``). A
new value on an axis describes itself and needs no branch here; its cost is a rule
(:mod:`looplm.accounting.rules`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch import nn

from looplm.accounting.cost import Call
from looplm.model import LoopLM
from looplm.resolution.schedule import core_lengths


@dataclasses.dataclass(frozen=True)
class Step:
    """One module call on the unrolled path: ``component`` (embedding, prelude, core,
    coda, topology, streams, step_embedding, halting, final_norm, head, ...), ``name``
    (e.g. ``core.1``), the module and how it is called.

    ``slot``: for core blocks and the per-pass additions, the pass's key t·passes + i
    (macro step t, pass i of it), as the model names it in the cache and the attention
    record. ``grad``: whether a training step backpropagates through the call (False for
    the first H − 1 cycles of ``streams.no_grad_cycles`` and for Q-halt's target readout,
    both run under ``torch.no_grad``): training counts it once, not ``training_multiplier``
    times. ``targets_only``: the call runs only in a forward given targets (training, or
    an evaluation loss): Q-halt's per-step norm + LM head that builds its BCE target (no
    gradient), the exit gate's per-step LM head of its expected objective (gradient)."""

    component: str
    name: str
    module: nn.Module
    call: Call
    slot: Optional[int] = None
    grad: bool = True
    targets_only: bool = False


def execution_plan(model: LoopLM, seq_len: int, batch: int = 1, *, targets: bool = False) -> list[Step]:
    """The module calls of one full forward of ``model`` on [batch, seq_len], in order,
    loops unrolled, every position running every macro step (full compute).

    Embedding: the token table, plus a learned position table (``model.position: learned``)
    and its addition. The loop, per macro step t: ``passes`` core passes (one; or
    H·(L + 1) with two streams, slot t·passes + i), each preceded by its stream addition
    (two streams: X + Y + Z for a reasoning pass, Y + Z for a solution pass) and the step
    signal e_t; the topology step (single stream; two streams never call the topology);
    the halting rule's call (ACT: the unit d -> 1 and the readout accumulation Σ w·h;
    Q-halt: the q head d -> 1). ``targets``: also list the calls that run only in a forward
    given targets, flagged ``targets_only`` (Q-halt: the final norm and LM head on the
    solution at every macro step, under ``torch.no_grad``; the exit gate's expected
    objective: the LM head on the normed state of every step, with gradient, while the
    readout's final norm and head then run without backward, ``grad=False``).

    A multi-resolution iteration t (``model.resolution``, spiralformer.txt Alg. 1) adds S↓
    on the tokens of its L_t complete chunks, runs the core on L_t positions
    (:func:`~looplm.resolution.core_lengths`) and adds S↑ on those L_t latents (the router
    once per chunk, each chunk's g_t slots written, the causal shift a copy); the topology
    step runs at full resolution. A block's grown loop (SGT) is
    read from the block by its type's rule (``rules.py``: plain or grown block)."""
    cfg = model.cfg
    full = Call(batch, seq_len, seq_len, width=cfg.d_model)
    plan = [Step("embedding", "embed", model.embed, full)]
    if model.pos_embed is not None:
        plan.append(Step("embedding", "pos_embed", PositionCall(model.pos_embed), full))
    for j, block in enumerate(model.prelude):
        plan.append(Step("prelude", f"prelude.{j}", BlockCall(block, 0), full))
    if model.topology is not None:
        plan.extend(_recurrence_plan(model, seq_len, batch, targets))
    for j, block in enumerate(model.coda):
        plan.append(Step("coda", f"coda.{j}", BlockCall(block, 0), full))
    # the readout's logits carry the training loss unless the halting rule's own losses hold
    # the task loss (the exit gate's expected objective): then training runs them without backward
    trained = model.halting is None or model.halting.trains_readout
    plan.append(Step("final_norm", "norm", model.norm, full, grad=trained))
    plan.append(Step("head", "head", model.head, full, grad=trained))
    return plan


def _recurrence_plan(model: LoopLM, seq_len: int, batch: int, targets: bool) -> list[Step]:
    """The recurrence of :func:`execution_plan`, read from the axes' descriptions."""
    cfg = model.cfg
    streams, topology, halting, resolution = model.streams, model.topology, model.halting, model.resolution
    iterations = cfg.parsed_layout.iterations
    full = Call(batch, seq_len, seq_len, width=cfg.d_model)
    lengths = core_lengths(resolution.schedule, seq_len) if resolution is not None else [seq_len] * iterations
    signal = model.step_embedding is not None and model.step_embedding.enabled
    plan: list[Step] = []
    if streams.uses_topology:
        plan.append(Step("topology", "topology.start", topology, dataclasses.replace(full, phase="start")))
    for t in range(iterations):
        n = lengths[t]  # L_t positions: T at full resolution, the complete chunks otherwise
        call = Call(batch, n, n, iteration=t, width=cfg.d_model)
        at = dataclasses.replace(full, iteration=t)
        scaled = resolution is not None and not resolution.identity(t)
        stack = model.core[0 if cfg.share_core else t]
        for p in streams.schedule:
            slot, grad = t * streams.passes + p.index, p.grad
            if p.reads is not None:  # the pass's input is a sum of streams
                reads = dataclasses.replace(at, phase=p.reads)
                plan.append(Step("streams", f"streams.{slot}", streams, reads, slot, grad))
            if cfg.loop_input_norm and t > 0:  # the final norm on the state entering step t (Ouro)
                plan.append(Step("final_norm", f"loop_input_norm.{slot}", model.norm, at, slot, grad))
            if signal:  # x + e_t on the core's input, at full resolution
                plan.append(Step("step_embedding", f"step_embedding.{slot}", model.step_embedding, at, slot, grad))
            if scaled:
                g = resolution.schedule[t].chunk
                down = Call(batch, n * g, n * g, phase="down", iteration=t, width=cfg.d_model)
                plan.append(Step("resolution", f"resolution.down.{t}", ResolutionCall(resolution, t), down, slot, grad))
            for j, block in enumerate(stack):
                plan.append(Step("core", f"core.{j}", BlockCall(block, t), call, slot, grad))
            if scaled:
                up = Call(batch, n, n, phase="up", iteration=t, width=cfg.d_model)  # on the n latents
                plan.append(Step("resolution", f"resolution.up.{t}", ResolutionCall(resolution, t), up, slot, grad))
        if streams.uses_topology:
            plan.append(Step("topology", f"topology.step.{t}", topology, at))
        if halting.reads_norm:  # the exit gate reads norm(Y) every step
            plan.append(Step("final_norm", f"halting.norm.{t}", model.norm, at))
        if halting.evaluates:
            plan.append(Step("halting", f"halting.{t}", halting, at))
        if halting.reads_logits(targets):
            # Q-halt's BCE target 1[argmax head(norm(Y)) = target], under no_grad; the exit
            # gate's expected objective: L^(t) of head(norm(Y)) with gradient, on the norm it
            # already read for the gate
            grad = not halting.trains_readout
            if not halting.reads_norm:
                plan.append(Step("final_norm", f"halting.target.norm.{t}", model.norm, at, grad=grad,
                                 targets_only=True))
            plan.append(Step("head", f"halting.target.head.{t}", model.head, at, grad=grad, targets_only=True))
    return plan


class PositionCall(nn.Module):
    """A learned position table's lookup (as the token embedding's) and its addition to
    the token embeddings."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table


class ResolutionCall(nn.Module):
    """Iteration t's S↓ (``phase="down"``: on the n·g_t tokens of its n complete chunks)
    or S↑ and the causal shift (``phase="up"``: on the n chunk latents, writing n·g_t slots)."""

    def __init__(self, resolution: nn.Module, iteration: int):
        super().__init__()
        self.resolution, self.iteration = resolution, iteration


class BlockCall(nn.Module):
    """A block as it runs at one iteration (its mixer view for that iteration)."""

    def __init__(self, block: nn.Module, iteration: int):
        super().__init__()
        self.block, self.iteration = block, iteration
