"""A tiny looped teacher and the run configs of its students, for the distillation tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from looplm import LoopLM
from looplm.config import RunConfig
from looplm.distill import student_config
from looplm.mixers.gated_deltanet import GatedDeltaNetConfig
from looplm.model_config import ModelConfig

GDN = GatedDeltaNetConfig(expand_v=1.0, chunk_size=16)


def teacher_config(**fields: Any) -> ModelConfig:
    """d_model 32, 4 heads, layout 1+2R2+1 (4 distinct blocks), byte vocabulary."""
    return ModelConfig.from_dict({"d_model": 32, "n_heads": 4, "layout": "1+2R2+1", "max_seq_len": 64, **fields})


def frozen_teacher(seed: int = 0, **fields: Any) -> LoopLM:
    torch.manual_seed(seed)
    teacher = LoopLM(teacher_config(**fields)).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def student_run(teacher: LoopLM, keep: Sequence[int], out_dir: Path, **train: Any) -> RunConfig:
    """The student's run config: pydoc bytes, seq_len 32, batch 4, one log line per step."""
    train_fields = dict(out_dir=str(out_dir), max_steps=6, batch_size=4, lr=3e-3, warmup_steps=1, log_every=1,
                        eval_every=0, save_every=0, sample_tokens=0, device="cpu", precision="fp32")
    train_fields.update(train)
    return RunConfig.from_dict({
        "model": student_config(teacher.cfg, GDN, keep).to_dict(),
        "data": {"source": "pydoc", "tokenizer": "byte", "seq_len": 32, "val_batches": 2},
        "train": train_fields,
    })
