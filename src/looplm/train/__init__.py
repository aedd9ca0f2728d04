"""Training: optimiser, learning-rate schedule, checkpoints, metrics and the trainer, with
its seams (a loss function, a model factory, callbacks)."""

from looplm.train.callbacks import Callback, LossFn, lm_loss
from looplm.train.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from looplm.train.config import TrainConfig
from looplm.train.metrics import MetricsWriter, format_summary, perplexity, read_metrics, train_losses
from looplm.train.optim import build_optimizer
from looplm.train.params import parameter_counts
from looplm.train.schedule import lr_at
from looplm.train.trainer import Trainer

__all__ = [
    "Callback",
    "Checkpoint",
    "CheckpointError",
    "LossFn",
    "MetricsWriter",
    "TrainConfig",
    "Trainer",
    "build_optimizer",
    "format_summary",
    "lm_loss",
    "load_checkpoint",
    "lr_at",
    "parameter_counts",
    "perplexity",
    "read_metrics",
    "resolve_checkpoint",
    "save_checkpoint",
    "train_losses",
    "verify_checkpoint",
]
