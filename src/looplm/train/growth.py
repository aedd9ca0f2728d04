"""SGT growth as a trainer callback (sparse-growing-transformer.txt, Algorithm 1's outer loop; the growth itself
is :mod:`looplm.head_loop.training`).

After every optimiser step the step's entropies go into the EMA and a decision is taken
when due; every event is logged as a ``growth`` record. When the structure changes the
trainer's FLOPs per token are recounted from the grown model
(:meth:`~looplm.train.throughput.Throughput.recount`). The schedule is saved in
``trainer.pt`` under ``growth`` and restored with the structure it implies.
"""

from __future__ import annotations

import logging
from typing import Optional

from looplm.head_loop.training import Growth
from looplm.train.callbacks import Callback, TrainerView

logger = logging.getLogger("looplm")


class SGTGrowth(Growth, Callback):
    """Growth of ``trainer.model``; built before the model is wrapped for execution (its
    entropy hooks sit on the blocks), its optimiser taken from the trainer when used (the
    head arrangement moves the optimiser's state with the weights)."""

    state_key = "growth"

    def __init__(self, trainer: TrainerView):
        super().__init__(trainer.model, trainer.device)
        self.trainer = trainer

    def on_step_end(self, trainer: TrainerView, step: int) -> None:
        self.optimizer = trainer.optimizer
        for event in self.after_step(step, trainer.ranks.distributed):
            trainer.metrics.log("growth", step, **{k: v for k, v in event.items() if k != "step"})
            if event["action"] != "hold":
                trainer.throughput.recount(trainer.model)  # the structure changed
                logger.info("growth at step %d: %s %s (depth %s, heads %s)", step, event["action"],
                            event["block"], event["depth"], event["heads"])

    def load_state_dict(self, state: dict, step: Optional[int] = None) -> None:
        """Restore the schedule saved at ``step`` (default: the trainer's restored step)."""
        self.optimizer = self.trainer.optimizer
        super().load_state_dict(state, self.trainer.step if step is None else step)


def sgt_growth(trainer: TrainerView) -> Optional[SGTGrowth]:
    """The growth callback of a run with ``model.head_loop``, else None."""
    return SGTGrowth(trainer) if trainer.cfg.model.head_loop is not None else None
