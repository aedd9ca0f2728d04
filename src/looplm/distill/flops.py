"""What distillation's training steps cost, the teacher's forwards included (lt2.txt §5).

A distilled student's tokens leave out the teacher's pretraining (a sunk cost), but not the
teacher's work during distillation: every stage-1 step runs a teacher forward to record its
attention calls, every stage-2 step a teacher forward and its per-loop readouts. These
counts say what a stage's steps cost under a FLOP convention
(:mod:`looplm.accounting.conventions`), so a token saving can be read as a compute saving.

* stage 1 (:class:`~looplm.distill.stages.AlignmentLoss`): the teacher's forward, plus each
  call of a linear student mixer on the recorded teacher input, forward and backward
  (``training_multiplier`` × its forward). The input is the teacher's detached stream, so
  the backward never forms the input projections' input gradient: the count is high by
  those projections' forward FLOPs (the convention's multiplier has no finer grain).
* stage 2 and 3 (:class:`~looplm.distill.stages.KDLoss`) at a step of length L over the
  same tokens (``split_length``): the teacher's forward (its final readout included) and
  one readout head(norm(coda(h^(τ)))) per loop τ with weight w_τ > 0, without gradient;
  the student's forward and backward through the same readouts, its own final readout
  computed in the forward (for the logged cross-entropy) but not backpropagated.

Exact under the ``torch`` convention against ``torch.utils.flop_counter`` for softmax-attention
students (tests/distill/test_flops.py); the norms, softmaxes and top-k of the KD loss are not
counted, as no convention counts a softmax.
"""

from __future__ import annotations

from typing import Union

from looplm.accounting import count_flops
from looplm.accounting.conventions import Convention, get_convention
from looplm.accounting.cost import module_cost
from looplm.accounting.flops import FlopReport
from looplm.accounting.plan import execution_plan
from looplm.distill.config import KDConfig
from looplm.distill.losses import length_at, loop_weights, readout_loops
from looplm.mixers.attention import SoftmaxAttention
from looplm.model import LoopLM
from looplm.modules.block import Block

#: the components of one readout head(norm(coda(h))) (``LoopLM.read_out``)
READOUT = ("coda", "final_norm", "head")


def readout_flops(report: FlopReport) -> float:
    """Forward FLOPs of one readout of ``report``'s forward: coda, final norm and head."""
    return sum(report.components.get(c, 0.0) for c in READOUT)


def alignment_step_flops(teacher: LoopLM, student: LoopLM, seq_len: int, batch: int,
                         convention: Union[str, Convention] = "default") -> float:
    """One stage-1 step on [batch, seq_len]: the teacher's forward and every linear student
    mixer call on its recorded input, forward and backward (module docstring)."""
    conv = get_convention(convention)
    total = count_flops(teacher, seq_len, batch=batch, convention=conv).forward
    for step in execution_plan(student, seq_len, batch):
        if isinstance(step.module, Block) and not isinstance(step.module.attn, SoftmaxAttention):
            mixer = step.module.mixer_at(max(step.call.iteration, 0))
            total += conv.training_multiplier * module_cost(mixer, step.call).flops(conv)
    return total


def kd_step_flops(teacher: LoopLM, student: LoopLM, seq_len: int, batch: int, read_loops: int,
                  convention: Union[str, Convention] = "default") -> float:
    """One KD step on [batch, seq_len] reading out ``read_loops`` loops (those with w_τ > 0):
    the teacher's forward and readouts, the student's forward, backward and readouts."""
    conv = get_convention(convention)
    t = count_flops(teacher, seq_len, batch=batch, convention=conv)
    s = count_flops(student, seq_len, batch=batch, convention=conv)
    s_readout = readout_flops(s)
    # the student's final readout in its forward feeds only the logged cross-entropy: no backward
    student = s.training - (conv.training_multiplier - 1) * s_readout + read_loops * conv.training_multiplier * s_readout
    return t.forward + read_loops * readout_flops(t) + student


def alignment_flops(teacher: LoopLM, student: LoopLM, seq_len: int, batch: int, steps: int,
                    convention: Union[str, Convention] = "default") -> list[float]:
    """Cumulative stage-1 FLOPs after each step 0 … ``steps`` (every step alike)."""
    per_step = alignment_step_flops(teacher, student, seq_len, batch, convention)
    return [per_step * s for s in range(steps + 1)]


def kd_flops(teacher: LoopLM, student: LoopLM, seq_len: int, batch: int, steps: int, kd: KDConfig,
             lengths: tuple[int, ...], convention: Union[str, Convention] = "default") -> list[float]:
    """Cumulative KD-stage FLOPs after each step 0 … ``steps``: step t at its progressive
    length (``length_at``, the batch's tokens split into sequences of that length) reading
    the loops its weights w_t need (``loop_weights``), as :class:`KDLoss` runs it."""
    n_loops, cost, total, cumulative = readout_loops(student), {}, 0.0, [0.0]
    for step in range(steps):
        length = length_at(step, steps, lengths)
        weights = loop_weights(step, steps, n_loops, kd.schedule, kd.warmup_fraction, kd.uniform_fraction)
        key = (length, sum(w > 0 for w in weights))
        if key not in cost:
            cost[key] = kd_step_flops(teacher, student, length, batch * seq_len // length, key[1], convention)
        total += cost[key]
        cumulative.append(total)
    return cumulative
