"""Task evaluation as a trainer callback (``data.source=task:NAME``).

At every evaluation the task's metrics are logged as a ``task_eval`` record, before the
validation loss, and the state-tracking curriculum advances
(:class:`~looplm.tasks.TaskEvaluator`); the run's sample is a greedy answer to one
evaluation problem, and the summary's ``task`` field the last record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from looplm.eval.tasks import task_evaluator
from looplm.train.callbacks import Callback, TrainerView

if TYPE_CHECKING:
    from looplm.eval.tasks import TaskEvaluator


class TaskEvaluation(Callback):
    """Logs ``task_eval`` at each evaluation through ``evaluator``."""

    def __init__(self, evaluator: TaskEvaluator):
        self.evaluator = evaluator

    def on_eval(self, trainer: TrainerView, step: int) -> None:
        with trainer.autocast():
            trainer.metrics.log("task_eval", step, **self.evaluator.evaluate(trainer.model, step))

    def sample(self, trainer: TrainerView) -> str:
        """A greedy answer to one evaluation problem (the run's sample)."""
        with trainer.autocast():
            return self.evaluator.sample(trainer.model)

    def on_fit_end(self, trainer: TrainerView, summary: dict[str, Any]) -> None:
        summary["task"] = self.evaluator.last  # the last task_eval record (n_max, ...)


def task_evaluation(trainer: TrainerView) -> Optional[TaskEvaluation]:
    """The task callback of a run on a task source, else None."""
    evaluator = task_evaluator(trainer.cfg, trainer.stream, trainer.ranks.rank, trainer.ranks.world_size)
    return None if evaluator is None else TaskEvaluation(evaluator)
