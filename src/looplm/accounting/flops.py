"""FLOP counter over the unrolled computation, with a per-component breakdown.

The counter walks the model's execution plan (:func:`~looplm.accounting.plan.execution_plan`:
embed (and a learned position table), prelude blocks, the topology's start, each macro
step's core passes with that iteration's mixer view (one, or H·(L + 1) with two streams,
each with its stream and step-signal additions), the topology step and the halting rule,
coda, final norm, head) and asks a *rule* for each module's cost
(:func:`~looplm.accounting.cost.module_cost`: the module's own ``flop_cost``, beside
its class). A :class:`~looplm.accounting.conventions.Convention`
weighs the cost's terms. Looped blocks are counted once per pass (LT2's convention), every
position running every macro step (full compute; :func:`realised_block_passes` reads what
adaptive halting actually needed from a model output). A new mechanism (resolution
schedules, SGT head passes, halting) describes its calls on its axis and its cost on its
module, not a branch here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from looplm.accounting.conventions import Convention, get_convention
from looplm.accounting.cost import Cost, module_cost
from looplm.accounting.plan import execution_plan
from looplm.model import LoopLM, ModelOutput
from looplm.model_config import ModelConfig

# ------------------------------------------------------------------ the report


@dataclasses.dataclass
class FlopReport:
    """FLOPs of one forward of ``batch`` sequences of ``seq_len`` tokens under ``convention``.

    forward / training: per batch of sequences; per_token: forward / (batch·seq_len);
    components: forward FLOPs per component (embedding, prelude, core, coda, topology,
    streams, step_embedding, halting, final_norm, head), summing to ``forward``; steps:
    forward FLOPs per plan step name, summed over iterations; costs: the unweighted terms
    per component. ``forward`` is an inference forward (no targets).

    targets_only: forward FLOPs of the calls that run only when the forward is given
    targets (Q-halt's per-step target readout, the exit gate's per-step LM heads under its
    expected objective), per plan step name; they are not in ``forward`` or
    ``components``, they are in ``training`` (once where they run under ``torch.no_grad``,
    ``training_multiplier`` times the ``targets_only_grad`` part that is backpropagated)
    and in :attr:`forward_with_targets`. no_grad: the part of
    ``forward`` that training runs without gradient (TRM's no-grad cycles), counted once
    in ``training``. weights_only: the part of ``forward`` whose backward computes weight
    gradients alone (``Step.input_grad`` false), counted twice in ``training``.
    training_only: forward FLOPs that only a training-mode forward adds
    (DSA's index scores of the queries before top_k, for its indexer loss), in ``training``
    like the call they belong to (``training_only_grad`` the backpropagated part). training:
    see :attr:`training`."""

    convention: Convention
    seq_len: int
    batch: int
    forward: float
    components: dict[str, float]
    steps: dict[str, float]
    costs: dict[str, Cost]
    targets_only: dict[str, float] = dataclasses.field(default_factory=dict)
    targets_only_grad: float = 0.0
    no_grad: float = 0.0
    embedding_matmul: float = 0.0  # the embedding lookups' one-hot matmul FLOPs (``convention.embedding``)
    weights_only: float = 0.0
    training_only: float = 0.0
    training_only_grad: float = 0.0

    @property
    def training(self) -> float:
        """One training step's FLOPs: ``training_multiplier`` × the forward of every call
        the backward runs through; an embedding counted as a matmul (``convention.embedding``)
        and the calls whose input carries no gradient (``weights_only``) 2 × their forward
        (forward and weight gradient, no input gradient); calls run under
        ``torch.no_grad`` (no-grad cycles, Q-halt's target readout) once; the calls given
        targets that the backward runs through (the exit gate's per-step heads) and the work
        only a training-mode forward does (``training_only``) like the rest."""
        extra = sum(self.targets_only.values()) - self.targets_only_grad + self.training_only - self.training_only_grad
        weights = self.embedding_matmul + self.weights_only
        grad = self.forward - self.no_grad - weights + self.targets_only_grad + self.training_only_grad
        return self.convention.training_multiplier * grad + 2 * weights + self.no_grad + extra

    @property
    def forward_with_targets(self) -> float:
        """A forward given targets (an evaluation loss): ``forward`` + ``targets_only``."""
        return self.forward + sum(self.targets_only.values())

    @property
    def forward_per_token(self) -> float:
        return self.forward / (self.batch * self.seq_len)

    @property
    def training_per_token(self) -> float:
        return self.training / (self.batch * self.seq_len)

    def to_dict(self) -> dict:
        return {
            "convention": self.convention.name,
            "seq_len": self.seq_len,
            "batch": self.batch,
            "forward_flops": self.forward,
            "training_flops": self.training,
            "forward_flops_per_token": self.forward_per_token,
            "training_flops_per_token": self.training_per_token,
            "components": self.components,
            "steps": self.steps,
            "targets_only": self.targets_only,
            "targets_only_grad_flops": self.targets_only_grad,
            "training_only_flops": self.training_only,
            "no_grad_flops": self.no_grad,
            "weights_only_flops": self.weights_only,
        }


def build_meta_model(cfg: ModelConfig) -> LoopLM:
    with torch.device("meta"):
        return LoopLM(cfg)


def count_flops(
    model_or_cfg: Union[LoopLM, ModelConfig],
    seq_len: Optional[int] = None,
    *,
    batch: int = 1,
    convention: Union[str, Convention] = "default",
    iterations: Optional[int] = None,
) -> FlopReport:
    """Forward (and training) FLOPs of a full forward on [batch, seq_len] (default:
    ``max_seq_len``), looped blocks counted once per pass, every position running every
    macro step (what adaptive halting saved: :func:`realised_block_passes`). ``iterations``:
    the loop count r run (default the layout's T), e.g. a count ``model.depth`` drew."""
    conv = get_convention(convention)
    model = build_meta_model(model_or_cfg) if isinstance(model_or_cfg, ModelConfig) else model_or_cfg
    seq_len = seq_len or model.cfg.max_seq_len
    components: dict[str, float] = {}
    steps: dict[str, float] = {}
    costs: dict[str, Cost] = {}
    targets_only: dict[str, float] = {}
    no_grad = embedding_matmul = weights_only = targets_only_grad = training_only = training_only_grad = 0.0
    reads_training: dict[int, bool] = {}  # per module of the plan: does a rule below it read call.training
    for step in execution_plan(model, seq_len, batch, targets=True, iterations=iterations):
        if step.component == "head" and not conv.head:
            cost = Cost()
        else:
            cost = module_cost(step.module, step.call)
        flops = cost.flops(conv)
        if step.targets_only:
            targets_only[step.name] = targets_only.get(step.name, 0) + flops
            targets_only_grad += flops if step.grad else 0.0
            continue
        key = id(step.module)
        if key not in reads_training:
            reads_training[key] = any(getattr(m, "flop_cost_reads_training", False) for m in step.module.modules())
        if reads_training[key]:
            more = module_cost(step.module, dataclasses.replace(step.call, training=True)).flops(conv) - flops
            training_only += more
            training_only_grad += more if step.grad else 0.0
        components[step.component] = components.get(step.component, 0) + flops
        steps[step.name] = steps.get(step.name, 0) + flops
        costs[step.component] = costs.get(step.component, Cost()) + cost
        if not step.grad:
            no_grad += flops
        elif not step.input_grad:
            weights_only += flops
        elif conv.embedding:
            embedding_matmul += conv.flops_per_mac * cost.embed
    return FlopReport(conv, seq_len, batch, sum(components.values()), components, steps, costs,
                      targets_only=targets_only, targets_only_grad=targets_only_grad, no_grad=no_grad,
                      embedding_matmul=embedding_matmul, weights_only=weights_only, training_only=training_only,
                      training_only_grad=training_only_grad)


def realised_block_passes(output: ModelOutput, mask: Optional[torch.Tensor] = None) -> float:
    """Mean block passes per token that a forward's positions needed, from
    ``output.block_passes`` ([B, T]: prelude + core·steps·passes + coda, steps being the
    macro steps the position ran before halting). ``mask`` [B, T] (e.g. the attention
    mask): average over its true positions only.

    The execution plan and :func:`count_flops` count full compute, ``cfg.block_passes``
    per token; this is the adaptive share of it. The batched forward itself computes every
    position until the last one halts (frozen positions are recomputed and discarded), so
    its executed passes are the maximum over positions, not this mean (without a cache
    the loop stops once every position has halted)."""
    if output.block_passes is None:
        raise ValueError("output.block_passes is None: only a looped model reports its realised passes "
                         "(a dense model runs every block once per token)")
    passes = output.block_passes.float()
    if mask is None:
        return float(passes.mean())
    mask = mask.to(torch.bool)
    if not bool(mask.any()):
        raise ValueError("mask selects no position")
    return float(passes[mask].mean())
