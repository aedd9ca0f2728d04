"""Procedurally generated tasks as data sources: ``data.source=task:NAME``.

- ``task:copy``, ``task:reverse``, ``task:addition``: the character-level tasks of
  autoregressive-TRM (App. B), 14-token vocabulary, loss on the answer only, evaluated
  out of distribution at α·L_train by greedy decoding (:func:`looplm.eval.tasks.evaluate_task`);
- ``task:state_tracking``: LT2's state-based recall (§4.6) with its n = m curriculum.

Parameters are the nested ``data.task`` config (:class:`TaskConfig`). The Trainer builds
the stream with :func:`looplm.data.train_stream` and calls
:class:`looplm.eval.tasks.TaskEvaluator` at each evaluation (metrics go to
``metrics.jsonl`` as ``task_eval`` events).
"""

from looplm.tasks.character import Problem, answer_length, example_tokens, make_problem
from looplm.tasks.config import TASK_NAMES, TaskConfig, is_task_source, task_name
from looplm.tasks.metrics import CharacterScores, quartile_bounds, score
from looplm.tasks.state_tracking import Curriculum, make_program, program_tokens
from looplm.tasks.stream import GeneratedTask, TaskStream, pack_rows, task_validation_batches
from looplm.tasks.tokenizers import CharacterTokenizer, ProgramTokenizer

__all__ = [
    "TASK_NAMES",
    "CharacterScores",
    "CharacterTokenizer",
    "Curriculum",
    "GeneratedTask",
    "Problem",
    "ProgramTokenizer",
    "TaskConfig",
    "TaskStream",
    "answer_length",
    "example_tokens",
    "is_task_source",
    "make_problem",
    "make_program",
    "pack_rows",
    "program_tokens",
    "quartile_bounds",
    "score",
    "task_name",
    "task_validation_batches",
]
