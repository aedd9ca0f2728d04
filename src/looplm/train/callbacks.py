"""The trainer's seams: the loss function and the callback protocol.

A :class:`~looplm.train.Trainer` is a short loop over parts. What a run optimises is a
*loss function* handed to it (:data:`LossFn`, :func:`lm_loss` by default); what happens
around the steps is a list of :class:`Callback` objects, called in order:

* ``on_start(trainer)``: once, when the trainer is built (after a checkpoint is restored
  and the ``start``/``resume`` record is written);
* ``on_step_end(trainer, step)``: after each optimiser step, ``step`` the steps completed;
  the step's values are still on the device (read nothing back here: a step has no host
  sync, see :meth:`Trainer.fit`);
* ``on_eval(trainer, step)``: at each evaluation, in list order (the trainer's own
  parts come first: task evaluation, then the validation loss);
* ``on_fit_end(trainer, summary)``: before ``summary.json`` is written; may fill fields.

A callback with a ``state_key`` is saved in every checkpoint's ``trainer.pt`` under that
key (``state_dict()``) and restored on resume (``load_state_dict(state)``, after the
trainer's own progress: ``trainer.step`` is the restored step), so a resumed run continues
exactly. SGT growth (:mod:`looplm.train.growth`), task evaluation
(:mod:`looplm.train.task_eval`), the validation loss (:mod:`looplm.train.validation`) and
distillation's evaluations (:mod:`looplm.distill.stages`) are callbacks.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
from torch import nn

if TYPE_CHECKING:  # looplm.config imports looplm.train.config, so a runtime import here would be circular
    from looplm.config import RunConfig
    from looplm.model_config import ModelConfig
    from looplm.train.distributed import Ranks
    from looplm.train.metrics import MetricsWriter
    from looplm.train.throughput import Throughput

#: ``loss_fn(model, inputs, targets, step) -> (loss, aux)``: the loss to minimise on one
#: micro-batch [B, T] (a scalar tensor) and named terms logged as ``aux_NAME`` (0-d
#: tensors, averaged over micro-batches and ranks without a host sync). ``model`` is the
#: module as wrapped for execution (DDP, compile); ``step`` the optimiser steps completed.
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
            step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The default objective: the model's own training loss (next-token cross-entropy plus
    its auxiliary terms: ponder cost, Q-halt BCE, DSA's indexer), those terms as ``aux``."""
    out = model(inputs, targets)
    return out.loss, out.aux_losses


def default_objective(model_cfg: "ModelConfig", seed: int, loss_rows: int = 0) -> LossFn:
    """The default objective of a run of ``model_cfg``: :func:`lm_loss`, or, when
    ``model.depth`` draws a count per step (Huginn's log-normal Poisson), the model's own
    loss at the count drawn for (``train.seed``, step), passed as ``iterations=``
    (:meth:`looplm.depth.DepthConfig.count`: a pure function, so a resumed run draws the
    same counts and every rank the same). Every micro-batch of a step runs the step's count.
    A custom ``loss_fn`` draws its own with the same call. ``loss_rows`` > 0: the
    cross-entropy without the logits (``train.loss_rows``, ``LoopLM.forward``)."""
    depth, mean = model_cfg.depth, model_cfg.iterations
    if not depth.sampled and not loss_rows:
        return lm_loss
    rows = {"loss_rows": loss_rows} if loss_rows else {}

    def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
             step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        count = {"iterations": depth.count(mean, seed, step)} if depth.sampled else {}
        out = model(inputs, targets, **rows, **count)
        return out.loss, out.aux_losses

    return loss


class TrainerView(Protocol):
    """What a callback (and the checkpointer) sees of :class:`looplm.train.Trainer`: the
    run's parts, and its progress (saved in ``trainer.pt``). A protocol, so that the parts
    need not import the loop that calls them."""

    cfg: RunConfig
    out_dir: Path
    device: torch.device
    ranks: Ranks
    parallel: str  # none, ddp or fsdp
    model: nn.Module  # the plain model (under FSDP sharded in place)
    optimizer: torch.optim.Optimizer
    stream: Any  # the training stream: next() a batch, state_dict / load_state_dict
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    metrics: MetricsWriter
    throughput: Throughput
    callbacks: list[Callback]
    resumed_from: Optional[Path]  # the checkpoint this process continued from
    step: int  # optimiser steps completed
    tokens_seen: int
    bad_steps: int
    skipped_steps: int
    best_val_loss: Optional[float]
    last_train_loss: Optional[float]
    last_val_loss: Optional[float]
    train_time_s: float

    def autocast(self) -> contextlib.AbstractContextManager: ...


class Callback:
    """A part of a run called at the points of the module docstring; every hook does
    nothing by default, so a callback overrides only the ones it needs."""

    #: the key of this callback's state in ``trainer.pt`` (None: nothing to resume)
    state_key: Optional[str] = None

    def on_start(self, trainer: TrainerView) -> None:
        pass

    def on_step_end(self, trainer: TrainerView, step: int) -> None:
        pass

    def on_eval(self, trainer: TrainerView, step: int) -> None:
        pass

    def on_fit_end(self, trainer: TrainerView, summary: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> Any:
        """What must be saved for an exact resume (only read when ``state_key`` is set)."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restore what :meth:`state_dict` returned at the checkpoint's step."""
