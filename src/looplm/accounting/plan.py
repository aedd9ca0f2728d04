"""The execution plan: the module calls of one full forward, in order, loops unrolled.

The recurrence is not re-implemented here: each axis lists the module calls of its part
of a macro step (a :class:`~looplm.accounting.cost.Step` per call) beside the code that
runs them, and the plan concatenates those lists in the order ``LoopLM._recur`` runs
them: the streams' start (``streams.start_calls``: the topology's start, or nothing), then
per macro step t the streams' step (``streams.step_calls``: per core pass its input's
stream sum, the model's pass — loop-input norm, step signal, the core or the resolution's
S↓ -> core -> S↑ (``LoopLM._pass_calls``, ``resolution.pass_calls``) — and the topology
step) and the halting rule's observation (``halting.step_calls``). A new value on an axis
describes its own calls and needs no branch here; its cost is its module's ``flop_cost``
(:mod:`looplm.accounting.cost`). tests/accounting/test_plan_order.py holds the plan's
order of module calls to a real forward's, over every axis value.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch import nn

from looplm.accounting.cost import Call, Cost, Step, in_pass, module_cost
from looplm.halting import Readout
from looplm.model import LoopLM

__all__ = ["PositionCall", "Step", "execution_plan"]


def execution_plan(model: LoopLM, seq_len: int, batch: int = 1, *, targets: bool = False,
                   iterations: Optional[int] = None) -> list[Step]:
    """The module calls of one full forward of ``model`` on [batch, seq_len], in order,
    loops unrolled, every position running every macro step (full compute).

    Embedding: the token table, plus a learned position table (``model.position: learned``)
    and its addition. The loop, per macro step t: ``passes`` core passes (one; or
    H·(L + 1) with two streams, slot t·passes + i), each preceded by its stream addition
    (two streams: X + Y + Z for a reasoning pass, Y + Z for a solution pass) and the step
    signal e_t; the topology step (single stream; two streams never call the topology);
    the halting rule's calls (ACT: the unit d -> 1 and the readout accumulation Σ w·h;
    Q-halt: the q head d -> 1). ``targets``: also list the calls that run only in a forward
    given targets, flagged ``targets_only`` (Q-halt: the final norm and LM head on the
    solution at every macro step, under ``torch.no_grad``; the exit gate's expected
    objective: the LM head on the normed state of every step, with gradient, while the
    readout's final norm and head then run without backward, ``grad=False``).

    A multi-resolution iteration t (``model.resolution``, spiralformer.txt Alg. 1) adds S↓
    on the tokens of its L_t complete chunks, runs the core on L_t positions
    (:func:`~looplm.resolution.core_lengths`) and adds S↑ on those L_t latents; the
    topology step runs at full resolution. A block's grown loop (SGT) is in the block's
    own ``flop_cost`` (plain or grown block).

    ``iterations``: the loop count r the forward runs (default the layout's T; a count drawn
    by ``model.depth`` or chosen at inference). Under ``model.depth.backprop_window`` = k the
    first r − k macro steps run without gradient in training (``grad=False``: counted once)."""
    if iterations is not None:
        model._check_iterations(iterations, None)  # the counts the forward runs, or its ConfigError
    full = Call(batch, seq_len, seq_len, width=model.cfg.d_model)
    plan = [Step("embedding", "embed", model.embed, full)]
    if model.pos_embed is not None:
        plan.append(Step("embedding", "pos_embed", PositionCall(model.pos_embed), full))
    names = model.cfg.structure.names_of
    plan += [Step("prelude", name, block, full) for name, block in zip(names("prelude"), model.prelude, strict=True)]
    if model.topology is not None:
        plan += _recurrence_plan(model, full, targets, iterations or model.cfg.iterations)
    plan += [Step("coda", name, block, full) for name, block in zip(names("coda"), model.coda, strict=True)]
    # the readout's logits carry the training loss unless the halting rule's own losses hold
    # the task loss (the exit gate's expected objective): then training runs them without backward
    trained = model.halting is None or model.halting.trains_readout
    plan.append(Step("final_norm", "norm", model.norm, full, grad=trained))
    plan.append(Step("head", "head", model.head, full, grad=trained))
    if model.halting is not None and not model.halting.trains_lm:
        # the LM frozen (Ouro's Stage II): no input needs a gradient, so the backward runs
        # through the halting rule's own calls alone, into their weights
        plan = [dataclasses.replace(s, grad=s.grad and s.module is model.halting, input_grad=False) for s in plan]
    return plan


def _recurrence_plan(model: LoopLM, full: Call, targets: bool, iterations: int) -> list[Step]:
    """The recurrence of :func:`execution_plan`: the axes' descriptions in ``_recur``'s order."""
    streams, topology, halting = model.streams, model.topology, model.halting
    readout = Readout(model.norm, model.head)
    plan = streams.start_calls(topology, full)
    no_grad = model.cfg.depth.no_grad_iterations(iterations)  # truncated backprop: steps t < r − k
    # no-grad cycles detach each step's output from the next: unless the halting rule reads
    # every step's output with gradient, the backward reaches the last macro step alone
    last_only = streams.detaches_steps and not halting.reads_every_step
    grad = True  # the state entering the loop (the prelude's output) carries a gradient
    for t in range(iterations):
        at = dataclasses.replace(full, iteration=t, reuses_first_step_kv=halting.reuses_first_step_kv(t),
                                 last=t == iterations - 1, state_grad=grad and not (streams.detaches_steps and t > 0))
        grad = t >= no_grad and (not last_only or t == iterations - 1)
        plan += in_pass(streams.step_calls(topology, t, at, model._pass_calls(t, at)), grad=grad)
        plan += halting.step_calls(t, at, readout, targets)
    return plan


class PositionCall(nn.Module):
    """A learned position table's lookup (as the token embedding's) and its addition to
    the token embeddings."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table

    def flop_cost(self, call: Call) -> Cost:
        """The table's lookup (as the token embedding's: a one-hot matmul where the
        convention counts one) plus its addition to the token embeddings."""
        return module_cost(self.table, call) + Cost(bias=call.rows * self.table.embedding_dim)
