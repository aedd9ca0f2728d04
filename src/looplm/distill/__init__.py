"""LT2's distillation of a pretrained looped transformer into a linear-time hybrid
(lt2.txt §5): ``looplm distill TEACHER [STUDENT_CONFIG] [key=value ...] [--stage ...]``.

config (the ``distill`` section), student (the student built from the teacher), alignment
(stage 1), selection (the kept-attention set F), losses (the per-loop KD loss and its
schedules), stages (each stage a Trainer run, and the pipeline)."""

from looplm.distill.config import DistillConfig, DistillRunConfig, KDConfig, StageConfig
from looplm.distill.losses import kd_loss, loop_weights, topk_kl
from looplm.distill.selection import Selection, uniform_layers
from looplm.distill.stages import load_distill_config, run_distill
from looplm.distill.student import init_student, load_teacher, student_config

__all__ = [
    "DistillConfig",
    "DistillRunConfig",
    "KDConfig",
    "Selection",
    "StageConfig",
    "init_student",
    "kd_loss",
    "load_distill_config",
    "load_teacher",
    "loop_weights",
    "run_distill",
    "student_config",
    "topk_kl",
    "uniform_layers",
]
