"""Configuration of the procedurally generated tasks: ``data.source=task:NAME`` plus ``data.task``.

A task is selected by the data source (``task:copy``, ``task:reverse``, ``task:addition``,
``task:state_tracking``); its parameters live in the nested ``data.task`` mapping, a
:class:`TaskConfig`. Fields a task does not use are ignored by it (the character tasks use
the length and evaluation fields, the state-tracking task the curriculum fields and
``eval_samples`` / ``eval_batch_size``).

``looplm.data.config`` imports this module and hands it the parsed task name; the two
helpers that take a ``data.source`` string read its kind from
:mod:`looplm.data.source_kinds`, imported on use (``looplm.data`` imports this module).
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Any, Optional

from looplm.config_base import Config, ConfigError, check
from looplm.tasks.character import example_tokens
from looplm.tasks.state_tracking import program_tokens

CHARACTER_TASKS = ("copy", "reverse", "addition")
TASK_NAMES = (*CHARACTER_TASKS, "state_tracking")
#: ``data.tokenizer`` values accepted with a task source: the default (unused) or ``task``.
TASK_TOKENIZER_SPECS = ("byte", "task")


@dataclasses.dataclass(frozen=True)
class TaskConfig(Config):
    """Parameters of a generated task (``data.task``).

    Character tasks (autoregressive-TRM App. B.3): training inputs have a length drawn
    uniformly from ``[min_length, train_length]`` (``min_length = train_length`` is the
    authors' fixed-length setting); evaluation uses ``eval_samples`` fixed problems at
    each length ``round(α · train_length)`` for α in ``eval_alphas`` (paper: α ∈ {1, 1.5,
    2, 3, 5}, 100 samples per condition), decoded greedily ``eval_batch_size`` at a time.
    ``heldout``: the share of problems (by a hash of the prompt, :func:`~looplm.tasks.character.held_out`)
    that training never draws; validation and the evaluation at lengths up to
    ``train_length`` draw from them only, so an α ≤ 1 score measures problems the model
    never saw (with 2-digit operands there are only 10⁴ problems: without it the test set
    is trained on). The evaluation also reports ``seen``: the same metrics on training
    problems of length ``train_length``. ``0`` turns the split off (every problem can be
    trained on; no ``seen`` report).

    State tracking (LT2 §4.6): stages n = m of ``curriculum``; the stream advances to the
    next stage when the evaluation accuracy on the current one reaches ``advance_at``
    (``0`` advances at every evaluation, for tests).
    """

    train_length: int = 10
    min_length: int = 1
    eval_alphas: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 5.0)
    eval_samples: int = 100
    eval_batch_size: int = 100
    curriculum: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    advance_at: float = 0.90
    heldout: float = 0.1

    def __post_init__(self) -> None:
        check(self.train_length >= 1, "data.task.train_length", self.train_length, "an integer >= 1")
        check(
            1 <= self.min_length <= self.train_length, "data.task.min_length", self.min_length,
            f"an integer in [1, train_length={self.train_length}]",
        )
        check(
            len(self.eval_alphas) > 0 and all(a > 0 and math.isfinite(a) for a in self.eval_alphas)
            and len(set(self.eval_alphas)) == len(self.eval_alphas),
            "data.task.eval_alphas", list(self.eval_alphas), "a non-empty list of distinct numbers > 0",
        )
        check(self.eval_samples >= 1, "data.task.eval_samples", self.eval_samples, "an integer >= 1")
        check(self.eval_batch_size >= 1, "data.task.eval_batch_size", self.eval_batch_size, "an integer >= 1")
        check(
            len(self.curriculum) > 0 and all(m >= 5 for m in self.curriculum)
            and all(a < b for a, b in zip(self.curriculum, self.curriculum[1:])),
            "data.task.curriculum", list(self.curriculum),
            "a non-empty, strictly increasing list of sizes n = m >= 5 (five distinct pointers must fit)",
        )
        check(0.0 <= self.advance_at <= 1.0, "data.task.advance_at", self.advance_at, "a number in [0, 1]")
        check(0.0 <= self.heldout <= 0.5, "data.task.heldout", self.heldout,
              "a number in [0, 0.5]: the share of problems training never sees")

    def eval_length(self, alpha: float) -> int:
        """L_eval = α · L_train, rounded half up (α = 1.5, L_train = 5 → 8), at least 1."""
        return max(1, math.floor(alpha * self.train_length + 0.5))


def _source_kinds() -> ModuleType:
    """:mod:`looplm.data.source_kinds`, imported on use: ``looplm.data`` imports this module."""
    from looplm.data import source_kinds

    return source_kinds


def task_name(source: str) -> Optional[str]:
    """``"addition"`` for ``data.source="task:addition"``; None for any other source."""
    kinds = _source_kinds()
    parsed = kinds.parse_source(source)
    return parsed.name if isinstance(parsed, kinds.TaskSource) else None


def is_task_source(source: str) -> bool:
    return task_name(source) is not None


def _task_sources() -> str:
    return ", ".join(_source_kinds().TaskSource(n).spec() for n in TASK_NAMES)


def longest_training_tokens(name: str, task: TaskConfig) -> int:
    """Tokens of the longest training example of task ``name`` (all of it, final token included)."""
    if name == "state_tracking":
        m = max(task.curriculum)
        return program_tokens(m, m)
    return example_tokens(name, task.train_length)


def validate_task_data(name: Optional[str], tokenizer: str, seq_len: int, task: Any) -> Optional[TaskConfig]:
    """Check the task fields of a data config (the task ``name`` of a ``data.source=task:NAME``,
    None for other sources; ``data.tokenizer``, ``data.seq_len``, ``data.task``); return its
    TaskConfig (defaults filled in for a task source without ``data.task``), or None for
    other sources.

    Called from ``DataConfig.__post_init__``, so every error names a ``data.*`` field.
    """
    if isinstance(task, dict):  # a mapping from YAML, or DataConfig(task={...}) from Python
        task = TaskConfig.from_dict(task, prefix="data.task")
    elif task is not None and not isinstance(task, TaskConfig):
        raise ConfigError("data.task", task, "null or a mapping with keys "
                          + ", ".join(f.name for f in dataclasses.fields(TaskConfig)))
    if name is None:
        check(task is None, "data.task", task.to_dict() if isinstance(task, Config) else task,
              f"null unless data.source is task:NAME ({_task_sources()})")
        return None
    source = _source_kinds().TaskSource(name).spec()
    if name not in TASK_NAMES:
        raise ConfigError("data.source", source, f"one of {_task_sources()} for a generated task")
    task = task if task is not None else TaskConfig()
    check(
        tokenizer in TASK_TOKENIZER_SPECS, "data.tokenizer", tokenizer,
        "'byte' (the default) or 'task' with a task source: a task defines its own vocabulary "
        "(looplm.tasks), so data.tokenizer is not used",
    )
    need = longest_training_tokens(name, task) - 1  # inputs are every token but the last
    where = (f"n = m = {max(task.curriculum)} (the last stage of data.task.curriculum)" if name == "state_tracking"
             else f"data.task.train_length={task.train_length}")
    check(
        seq_len >= need, "data.seq_len", seq_len,
        f"an integer >= {need}: the longest training example of {source} at {where} has {need + 1} tokens, "
        f"one per row (lower the task size or raise data.seq_len)",
    )
    return task
