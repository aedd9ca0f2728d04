"""The validation loss as a trainer callback: at every evaluation, the mean loss over the
held-out batches on all ranks, logged as ``eval`` (``val_loss``, ``val_ppl``) and kept as
the trainer's ``last_val_loss`` and ``best_val_loss`` (saved in ``trainer.pt``)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from looplm.train.callbacks import Callback, TrainerView
from looplm.train.metrics import perplexity


class ValidationLoss(Callback):
    """Batches have the micro-batch size (``batch_size / grad_accum``), the size known to
    fit in memory; with ``train.loss_rows`` the loss is computed as in training, without
    the logits; a run without a validation split logs nothing."""

    @torch.no_grad()
    def on_eval(self, trainer: TrainerView, step: int) -> None:
        val_loss = self.mean_loss(trainer)
        if val_loss is None:
            return
        trainer.last_val_loss = val_loss
        if math.isfinite(val_loss) and (trainer.best_val_loss is None or val_loss < trainer.best_val_loss):
            trainer.best_val_loss = val_loss
        trainer.metrics.log("eval", step, val_loss=val_loss, val_ppl=perplexity(val_loss))

    @staticmethod
    def mean_loss(trainer: TrainerView) -> Optional[float]:
        """The language-model loss of ``trainer.model`` over its validation batches (None
        without any), averaged over the ranks."""
        if not trainer.val_batches:
            return None
        model = trainer.model
        model.eval()
        rows = trainer.cfg.train.loss_rows
        options = {"loss_rows": rows} if rows else {}  # the loss as training computes it: no logits
        total = torch.zeros((), device=trainer.device)
        for inputs, targets in trainer.val_batches:
            with trainer.autocast():
                total += model(inputs.to(trainer.device), targets.to(trainer.device), **options).lm_loss.float()
        model.train()
        mean = total / len(trainer.val_batches)  # equal-size batches without padding: the token mean
        return trainer.ranks.mean_(mean).item()
