"""Tiny runs for the trainer tests: a 4-block looped model on the built-in corpus, bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from looplm.config import RunConfig


def run_config(out_dir: Path, *, topology: str = "base", model: dict[str, Any] | None = None,
               **train: Any) -> RunConfig:
    """d_model 32, layout 1+1R2+1, seq_len 32, batch 4; one log line per step; no eval,
    checkpoint or sample unless asked (``train`` overrides TrainConfig fields)."""
    train_fields = dict(
        out_dir=str(out_dir), max_steps=6, batch_size=4, lr=3e-3, warmup_steps=1, log_every=1,
        eval_every=0, save_every=0, sample_tokens=0, device="cpu", precision="fp32",
    )
    train_fields.update(train)
    model_fields = dict(d_model=32, n_heads=4, layout="1+1R2+1", max_seq_len=64, topology={"kind": topology})
    model_fields.update(model or {})
    return RunConfig.from_dict({
        "model": model_fields,
        "data": {"source": "pydoc", "tokenizer": "byte", "seq_len": 32, "val_batches": 2},
        "train": train_fields,
    })


def checkpoint_weights(out_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(Path(out_dir) / "checkpoints" / f"step_{step:07d}" / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"
