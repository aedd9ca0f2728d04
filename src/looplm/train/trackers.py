"""Experiment trackers: the scalars of ``metrics.jsonl`` mirrored to TensorBoard and Weights & Biases.

``metrics.jsonl`` is always written: it is the run's own record, which resume, the
summary, probes and the ladder read. ``train.loggers`` adds trackers beside it; each
receives every event the trainer logs (``train``, ``eval``, ``skipped``, ``growth``,
``task_eval``, ...) as scalars named ``EVENT/FIELD`` (``train/loss``, ``eval/val_ppl``,
``train/tokens_per_s``, ``train/mfu``) at the event's optimiser step. Non-numeric
fields (names, lists) stay in the JSONL file only.

Both trackers are optional extras (``pip install 'looplm[track]'``). Weights & Biases
runs offline unless ``train.wandb_mode=online``: the run is written under
``OUT_DIR/wandb`` and can be uploaded later with ``wandb sync``; nothing leaves the
machine by default.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Optional

from looplm.errors import MissingExtra

#: The trackers ``train.loggers`` may name (``jsonl`` is the always-written metrics file).
LOGGERS = ("jsonl", "tensorboard", "wandb")


def scalars(event: str, fields: dict[str, Any]) -> dict[str, float]:
    """The finite numeric fields of one event, named ``event/field``."""
    out = {}
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[f"{event}/{name}"] = float(value)
    return out


class Tracker:
    """Receives each logged event; ``close`` flushes at the end of a run."""

    def log(self, event: str, step: int, fields: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release (called once, when training ends or fails)."""


class TensorBoardTracker(Tracker):
    """Scalars into ``OUT_DIR/tensorboard`` (``tensorboard --logdir OUT_DIR/tensorboard``);
    a resumed run appends a new event file to the same directory."""

    def __init__(self, out_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise MissingExtra("train.loggers=[tensorboard] needs tensorboard: pip install 'looplm[track]'") from err
        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def log(self, event: str, step: int, fields: dict[str, Any]) -> None:
        for name, value in scalars(event, fields).items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run under ``OUT_DIR/wandb``, offline unless ``mode="online"``.
    Its id is derived from the output directory, so a resumed run continues the same
    W&B run."""

    def __init__(self, out_dir: Path, project: str, mode: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError as err:
            raise MissingExtra("train.loggers=[wandb] needs wandb: pip install 'looplm[track]'") from err
        run_id = hashlib.blake2b(str(out_dir.resolve()).encode(), digest_size=8).hexdigest()
        (out_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=out_dir.name, id=run_id, resume="allow", dir=str(out_dir),
                              mode=mode, config=config)
        self.run.define_metric("*", step_metric="step")  # a resumed run logs its steps again: x is our step

    def log(self, event: str, step: int, fields: dict[str, Any]) -> None:
        values = scalars(event, fields)
        if values:
            self.run.log({**values, "step": step})

    def close(self) -> None:
        self.run.finish()


def build_trackers(loggers: tuple[str, ...], out_dir: Path, *, wandb_project: str, wandb_mode: str,
                   config: Optional[dict[str, Any]] = None) -> list[Tracker]:
    """The trackers ``loggers`` names besides the JSONL file (rank 0 only builds them)."""
    trackers: list[Tracker] = []
    if "tensorboard" in loggers:
        trackers.append(TensorBoardTracker(out_dir))
    if "wandb" in loggers:
        trackers.append(WandbTracker(out_dir, wandb_project, wandb_mode, config or {}))
    return trackers
