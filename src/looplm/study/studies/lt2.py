"""Study ``lt2``: looped against non-looped attention, GDN and the Full+GDN hybrid at matched
parameters, with the output gate (lt2.txt zero-shot table, §4.4, §4.6)."""

from __future__ import annotations

import json
from typing import Optional, Sequence

from looplm.data.source_kinds import TaskSource
from looplm.study import measures
from looplm.study.definition import Curve, Metric, PaperColumn, RunSpec, Size, Study
from looplm.study.results import describe_default
from looplm.study.studies.common import (
    LOSS_ROWS_NOTE,
    QUICK,
    STDLIB_NOTES,
    STDLIB_SWEEP,
    VAL_LOSS,
    cpu_lm,
    cpu_stdlib,
    lm_figures,
    stdlib_wall_time,
)

LT2_MIXERS = {
    "attention": ["model.mixer={kind: attention}", "model.hybrid=null"],
    "gdn": ["model.mixer={kind: gated_deltanet}", "model.hybrid=null"],
    "full+gdn": ["model.mixer={kind: gated_deltanet}",
                 "model.hybrid={mixer: {kind: attention}, ratio: '4:1', placement: interleave}"],
}


#: Layers of the state-tracking backbone: LT2 §4.6 uses 4; 5 here so that the 4:1 hybrid has its attention layer.
TASK_LAYERS = 5


def _lt2_runs(lm_preset: str, layers: int, loops: int, curriculum: list[int], seq_len: int,
              lm_size: Sequence[str], task_size: Optional[Sequence[str]]) -> dict[str, RunSpec]:
    """Each variant twice: ``/lm`` (language modelling) and ``/state`` (the state-tracking
    task; none when ``task_size`` is None)."""
    runs = {}
    for mixer, fields in LT2_MIXERS.items():
        for looped in (False, True):
            name = f"{mixer}-looped" if looped else mixer
            topology = f"model.topology={{kind: {'gated_residual' if looped else 'base'}}}"
            runs[f"{name}/lm"] = RunSpec(lm_preset, (
                *fields, f"model.layout={layers}R{loops}" if looped else f"model.layout={layers}", topology, *lm_size))
            if task_size is None:
                continue
            runs[f"{name}/state"] = RunSpec("task-state-tracking", (
                *fields, f"model.layout={TASK_LAYERS}R{loops}" if looped else f"model.layout={TASK_LAYERS}", topology,
                f"data.task.curriculum={json.dumps(curriculum)}", f"data.seq_len={seq_len}",
                f"model.max_seq_len={seq_len + 8}", *task_size))
    # LT2 §4.4: the SDPA output gate against the attention sink, on the looped attention model
    runs["attention-looped-gated/lm"] = RunSpec(lm_preset, (
        "model.mixer={kind: attention, output_gate: true}", "model.hybrid=null", f"model.layout={layers}R{loops}",
        "model.topology={kind: gated_residual}", *lm_size))
    return runs


def _lt2_describe(variant: str, runs: list) -> dict[str, str]:
    lm = next(r for r in runs if not isinstance(r.config.data.parsed_source, TaskSource))
    return describe_default(variant, [lm])


#: the state-tracking half of the default and stdlib sizes (a synthetic task: no corpus to repeat)
_LT2_CPU_TASK = ("model.d_model=64", "train.batch_size=8", "train.lr=1e-3", "train.max_steps=300", "train.eval_every=37",
                 "train.save_every=75", "train.keep_last=1", "train.log_every=50", "train.sample_tokens=0",
                 "train.device=cpu", "data.task.eval_samples=32")

_LT2_QUICK_TASK = ("model.d_model=16", "model.n_heads=2", "train.batch_size=2", "train.max_steps=4",
                   "train.eval_every=2", "train.save_every=0", "train.log_every=1", "train.sample_tokens=0",
                   "train.device=cpu", "data.task.eval_samples=2", "data.task.eval_batch_size=2")

LT2 = Study(
    name="lt2",
    title="LT2: looped against non-looped at matched parameters (lt2.txt Table 2, §4.6, shrunk)",
    paper="lt2.txt (LT2), zero-shot table (0.6B validation PPL) and §4.6 state-based recall (n_max)",
    claim="looping (T iterations of the same blocks) lowers the loss of attention, GDN and the Full+GDN hybrid "
          "at matched parameters, and raises the state-tracking n_max",
    sizes={
        "quick": Size(_lt2_runs("tiny-lt2-transformer", 5, 2, [5], 120, QUICK + ("data.seq_len=16",),
                                _LT2_QUICK_TASK), seeds=2),
        "default": Size(_lt2_runs("tiny-lt2-transformer", 5, 2, [5, 8], 176,
                                  ("model.d_model=64", *cpu_lm(300, seq_len=64)), _LT2_CPU_TASK),
                        seeds=3, wall_time="≈ 55 min on one thread (36 runs; ≈ 0.2 s per LM step and 0.3 s "
                                           "per state-tracking step measured, GDN's chunked recurrence the most)"),
        # the language-modelling runs on the unrepeated corpus; the state-tracking half is the
        # default size's (a synthetic task has no corpus to repeat, and at d = 64 no variant
        # passes its first stage even at 4000 steps: docs/results/lt2/investigation.md)
        "stdlib": Size(_lt2_runs("tiny-lt2-transformer", 5, 2, [5, 8], 176, cpu_stdlib(), None),
                       seeds=3, max_seeds=5, sweep=STDLIB_SWEEP, wall_time=stdlib_wall_time(7),
                       notes=STDLIB_NOTES + (LOSS_ROWS_NOTE,)),
        "paper": Size(_lt2_runs("lt2-0.6b-transformer", 25, 4, [8, 16, 32, 64, 128, 256], 4888, (),
                                ("model.d_model=256", "model.n_heads=4", "train.max_steps=100000")), seeds=3,
                      wall_time="0.6B, T = 4, 100B tokens per LM run (set data.source / data.tokenizer): ≈ 1.4e21 "
                                "FLOPs, over a month per run on one H100; the state-tracking part (up to 100k steps "
                                "per curriculum stage) days per run"),
    },
    metrics=(VAL_LOSS, Metric("n_max", "state n_max", 1, better="higher"),
             Metric("state_acc", "state acc (last)", 1, percent=True),
             Metric("sink_first", "first-token mass (loop 1)", 3), Metric("sink_last", "first-token mass (last loop)", 3)),
    measure=measures.lt2,
    # each mixer looped against itself run once (matched parameters); §4.4: the gate
    comparisons=(("attention-looped", "attention"), ("gdn-looped", "gdn"), ("full+gdn-looped", "full+gdn"),
                 ("attention-looped-gated", "attention-looped"), ("attention-looped-gated", "attention")),
    paper_columns=(
        PaperColumn("val PPL (0.6B)", "lt2.txt zero-shot table (tab:downstream), 0.6B rows, T = 4 (the table "
                    "has non-looped rows only for the Transformer)",
                    {"attention": "13.14", "attention-looped": "11.92", "gdn-looped": "12.06",
                     "full+gdn-looped": "11.43"}),
        PaperColumn("n_max", "lt2.txt §4.6, Fig. state-recall: Transformer caps at stage 4 (n_max 64) at every T; "
                    "looped Full+GDN reaches stage 5 (128)",
                    {"attention": "64", "attention-looped": "64", "full+gdn-looped": "128"}),
    ),
    figures=(*lm_figures(), Curve("n_max.png", "n_max", "state tracking: n_max over training", "step", "n_max")),
    describe=_lt2_describe,
    deviations=(
        "Shrunk: 5 LLaMA blocks at d = 64 looped T = 2 (paper: 0.6B, T = 4), pydoc bytes, 300 LM steps of "
        "16 × 64 tokens; the state-tracking curriculum is n = m ∈ {5, 8} (paper: 8 … 256, 100k steps per "
        "stage) with 300 steps of batch 8 at lr 1e-3 (paper: batch 32, lr 3e-4), d = 64 and 5 layers (paper: 4 "
        "layers, d = 256) so that the 4:1 hybrid has its attention layer.",
        "Non-looped = the same blocks run once (layout 5, base topology): matched parameters, half the compute.",
        "attention-looped-gated: the looped attention model with LT2's SDPA output gate (§4.4), language modelling "
        "only; the first-token attention mass columns (the attention sink, per loop iteration of the core; "
        "sink_by_loop in runs' study.json) are measured on 16 held-out sequences, blank for linear mixers.",
    ),
)


