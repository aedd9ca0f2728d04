"""What distillation's steps cost, the teacher's forwards included (looplm.distill.flops),
against what torch.utils.flop_counter measures while the stages' losses run."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from looplm import LoopLM
from looplm.accounting import count_flops
from looplm.distill import KDConfig, student_config
from looplm.distill.alignment import alignment_loss, record_teacher
from looplm.distill.flops import alignment_flops, alignment_step_flops, kd_flops, kd_step_flops
from looplm.distill.losses import length_at, loop_weights, readout_loops
from looplm.distill.stages import KDLoss
from looplm.mixers.linear_attention import LinearAttentionConfig
from tests.distill.helpers import frozen_teacher, student_run

LENGTHS = (8, 16, 32)


def measured(fn) -> int:
    """FLOPs torch's counter sees while ``fn`` runs, softmax attention as explicit matmuls
    (the CPU flash kernel has no FLOP formula; the ``torch`` convention counts every pair)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return sum(counter.get_flop_counts()["Global"].values())


@pytest.mark.parametrize("schedule", ["per_loop", "final"])
def test_every_kd_step_costs_what_the_kd_loss_runs(tmp_path, schedule):
    """Each step of a stage (progressive lengths 8/16/32 over the same 128 tokens; the
    per-loop schedule reads the last loop of 1+2R2+1 at step 0, both through its uniform half, then the last): the teacher's forward
    and readouts, the student's forward (its own final readout not backpropagated), backward
    and readouts, exactly; the cumulative count is their sum."""
    torch.manual_seed(0)
    teacher = frozen_teacher()
    cfg = student_run(teacher, [0, 1, 2, 3], tmp_path, max_steps=8)  # every block keeps attention
    student = LoopLM(cfg.model)
    kd = KDConfig(schedule=schedule)
    loss_fn = KDLoss(teacher, kd, LENGTHS, cfg)
    x, y = torch.randint(0, 257, (2, 4, 32))
    read = []
    total = 0
    for step in range(8):
        def kd_step():
            loss, _ = loss_fn(student, x, y, step)
            loss.backward()
        flops = measured(kd_step)
        length = length_at(step, 8, LENGTHS)
        weights = loop_weights(step, 8, readout_loops(student), schedule, kd.warmup_fraction, kd.uniform_fraction)
        read.append(sum(w > 0 for w in weights))
        assert kd_step_flops(teacher, student, length, 128 // length, read[-1], "torch") == flops, step
        total += flops
    assert kd_flops(teacher, student, 32, 4, 8, kd, LENGTHS, "torch")[-1] == total
    assert read == ([1, 2, 2, 2, 2, 1, 1, 1] if schedule == "per_loop" else [1] * 8)


def test_the_teacher_forward_is_what_distilling_adds_to_training_the_student():
    """A final-loop KD step is the student's training step plus the teacher's forward and one
    readout each (the student's logged readout runs forward only)."""
    teacher = frozen_teacher()
    student = LoopLM(student_config(teacher.cfg, teacher.cfg.mixer, [0, 1, 2, 3]))
    t, s = count_flops(teacher, 32, batch=4), count_flops(student, 32, batch=4)
    readout = s.components["coda"] + s.components["final_norm"] + s.components["head"]
    assert kd_step_flops(teacher, student, 32, 4, 1) == pytest.approx(t.forward + readout + s.training + readout)


@pytest.mark.parametrize("keep", [[], [1]])
def test_a_stage1_step_is_the_teacher_forward_and_every_linear_mixer_call_trained(keep):
    """Stage 1 (T = 64, one chunk, where the linear-attention core's formula is exact): the
    teacher's forward as measured, plus the convention's training multiplier (3) times the
    measured forward of every student mixer call the alignment loss makes: each block at each
    loop iteration, the kept attention (F, block 1 = the core's first block, run twice) left out."""
    torch.manual_seed(0)
    teacher = frozen_teacher()
    student = LoopLM(student_config(teacher.cfg, LinearAttentionConfig(), keep))
    x = torch.randint(0, 257, (2, 64))
    calls = []
    teacher_flops = measured(lambda: calls.extend(record_teacher(teacher, x)))
    with torch.no_grad():
        mixer_flops = measured(lambda: alignment_loss(student, calls))
    assert alignment_step_flops(teacher, student, 64, 2, "torch") == teacher_flops + 3 * mixer_flops
    per_step = alignment_step_flops(teacher, student, 64, 2)
    assert alignment_flops(teacher, student, 64, 2, 3) == [0.0, per_step, 2 * per_step, 3 * per_step]
