"""Training and validation batches from a generated task, with exact resume and sharding.

Example k of a split is generated from its own ``random.Random`` seeded by blake2b of
``(task, data.seed, split, k)``, so any example can be produced on its own, on any
machine, in any order. The training stream is the examples ``0, 1, 2, …``; global batch
``j`` is examples ``[j·G, (j+1)·G)``, ``G = batch_size · world_size``, and rank r takes
rows ``[r·batch_size, (r+1)·batch_size)`` of it (the :class:`~looplm.data.TrainStream`
contract). The resume state is the number of examples drawn (global) and, for the
state-tracking task, the curriculum.

One example per row: a row is the example's tokens without its last one (the inputs),
padded with the task's pad token; the targets are the next tokens where they are
supervised and -100 elsewhere (prompt, padding). Packing several examples into one row
would let an example attend to the ones before it; the paper holds "attention semantics"
fixed with one example per sequence (the authors' code pads each example to the block
size), so looplm does the same.
"""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch
from torch import Tensor

from looplm.targets import IGNORE_INDEX
from looplm.config_base import ConfigError
from looplm.tasks.character import Problem, answer_length, encode_problem, held_out, make_problem
from looplm.tasks.config import TaskConfig, task_name
from looplm.tasks.state_tracking import Curriculum, encode_program, make_program
from looplm.tasks.tokenizers import CharacterTokenizer, ProgramTokenizer

if TYPE_CHECKING:
    from looplm.data.config import DataConfig

Batch = tuple[Tensor, Tensor]
Example = tuple[list[int], list[bool]]  # token ids; per token, whether it is a training target
#: Draws tried for one problem on the requested side of the held-out split before giving up.
MAX_DRAWS = 1000


def example_rng(name: str, seed: int, split: str, index: int) -> random.Random:
    """The generator of example ``index`` of ``split``, the same on every machine."""
    digest = hashlib.blake2b(f"looplm.tasks:{name}:{seed}:{split}:{index}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


class GeneratedTask:
    """A task named by ``data.source=task:NAME`` with its ``data.task`` parameters."""

    def __init__(self, cfg: "DataConfig"):
        name = task_name(cfg.source)
        if name is None or cfg.task is None:
            raise ValueError(f"data.source={cfg.source!r} is not a task source (task:NAME)")
        self.name, self.cfg, self.seed, self.seq_len = name, cfg.task, cfg.seed, cfg.seq_len
        self.tokenizer: Union[CharacterTokenizer, ProgramTokenizer]
        if name == "state_tracking":
            self.tokenizer = ProgramTokenizer(max(256, max(cfg.task.curriculum)))
        else:
            self.tokenizer = CharacterTokenizer()

    @property
    def is_state_tracking(self) -> bool:
        return self.name == "state_tracking"

    def curriculum(self) -> Optional[Curriculum]:
        """A fresh curriculum for the state-tracking task (None for the others)."""
        task: TaskConfig = self.cfg
        return Curriculum(task.curriculum, task.advance_at) if self.is_state_tracking else None

    def problem(self, split: str, index: int, length: Optional[int] = None) -> Problem:
        """Character task: problem ``index`` of ``split``; the input length is ``length``,
        or uniform in ``[min_length, train_length]`` when None.

        With ``data.task.heldout > 0`` the ``train`` split never yields a held-out problem
        and every other split yields only held-out ones at lengths up to ``train_length``
        (longer inputs are never trained on): the example's generator draws again until
        the problem is on its side of the split."""
        rng = example_rng(self.name, self.seed, split, index)
        tc = self.cfg
        for _ in range(MAX_DRAWS):
            n = rng.randint(tc.min_length, tc.train_length) if length is None else length
            problem = make_problem(self.name, n, rng)
            if tc.heldout <= 0.0 or n > tc.train_length:
                return problem
            if held_out(self.name, problem, tc.heldout) == (split != "train"):
                return problem
        side = "training" if split == "train" else "held-out"
        at = f"length {length}" if length is not None else f"lengths {tc.min_length}..{tc.train_length}"
        raise ConfigError("data.task.heldout", tc.heldout,
                          f"a share that leaves {side} problems of task {self.name!r} at {at} "
                          f"(none in {MAX_DRAWS} draws; the problem space there is too small)")

    def seen_problems(self, count: int) -> list[Problem]:
        """The first ``count`` training problems of input length ``train_length``, in stream
        order: problems a run that trained past them has seen (the ``seen`` report)."""
        found, index = [], 0
        n = self.cfg.train_length
        while len(found) < count:
            problem = self.problem("train", index)
            index += 1
            if len(problem.answer) == answer_length(self.name, n):
                found.append(problem)
        return found

    def program(self, split: str, index: int, m: int) -> Example:
        """State tracking: program ``index`` of ``split`` with n = m."""
        words, answers = make_program(m, m, example_rng(self.name, self.seed, f"{split}:{m}", index))
        return encode_program(words, answers, self.tokenizer)

    def example(self, split: str, index: int, m: Optional[int] = None) -> Example:
        """Training-distribution example ``index`` of ``split`` (``m``: the curriculum stage)."""
        if self.is_state_tracking:
            if m is None:
                raise ValueError("the state-tracking task needs the curriculum stage m")
            return self.program(split, index, m)
        return encode_problem(self.problem(split, index))


def pack_rows(examples: Sequence[Example], seq_len: int, pad_id: int) -> Batch:
    """One example per row → ``(inputs, targets)``, each ``[len(examples), seq_len]`` int64.

    inputs: the example's tokens but the last, then ``pad_id``; targets: the next token
    where it is supervised, else -100 (prompt and padding)."""
    inputs = torch.full((len(examples), seq_len), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), seq_len), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, supervised) in enumerate(examples):
        n = len(ids) - 1
        if n > seq_len:
            raise ValueError(f"an example of {n + 1} tokens does not fit data.seq_len={seq_len} (+1)")
        ids_t = torch.tensor(ids, dtype=torch.long)
        inputs[row, :n] = ids_t[:-1]
        keep = torch.tensor(supervised[1:], dtype=torch.bool)
        targets[row, :n] = torch.where(keep, ids_t[1:], IGNORE_INDEX)
    return inputs, targets


def _check_parallel(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size")


class TaskStream:
    """Endless training batches ``(inputs, targets)``, each ``[batch_size, seq_len]`` int64,
    of a generated task (see the module docstring for order, sharding and resume).

    For the state-tracking task ``curriculum`` holds the stage being trained; the
    Trainer's evaluation advances it (:class:`~looplm.eval.tasks.TaskEvaluator`).
    """

    def __init__(self, cfg: "DataConfig", batch_size: int, rank: int = 0, world_size: int = 1):
        _check_parallel(batch_size, rank, world_size)
        self.task = GeneratedTask(cfg)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.examples = 0  # global examples drawn so far
        self.curriculum = self.task.curriculum()

    @property
    def tokenizer(self) -> Union[CharacterTokenizer, ProgramTokenizer]:
        return self.task.tokenizer

    def __iter__(self) -> "TaskStream":
        return self

    def __next__(self) -> Batch:
        b = self.batch_size
        first = self.examples + self.rank * b
        m = self.curriculum.current if self.curriculum is not None else None
        rows = [self.task.example("train", k, m) for k in range(first, first + b)]
        self.examples += b * self.world_size
        return pack_rows(rows, self.task.seq_len, self.tokenizer.pad_id)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position: ``{"task", "examples", "curriculum"}`` (the same on every rank)."""
        return {"task": self.task.name, "examples": self.examples,
                "curriculum": None if self.curriculum is None else self.curriculum.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, yielding exactly what the saved stream would have yielded next."""
        if state.get("task") != self.task.name:
            raise ValueError(f"cannot resume: the saved data position is not of task:{self.task.name} "
                             f"(saved: {state.get('task', 'a text corpus')!r}); data.source must be unchanged")
        self.examples = int(state["examples"])
        if self.curriculum is not None:
            self.curriculum.load_state_dict(state["curriculum"])


def task_validation_batches(cfg: "DataConfig", batch_size: int, rank: int = 0, world_size: int = 1) -> list[Batch]:
    """``cfg.val_batches`` fixed batches of held-out examples from the training distribution
    (split ``val``), dealt with the TrainStream data-parallel contract. Empty for the
    state-tracking task, whose distribution moves with the curriculum (its evaluation
    reports the loss on the current stage instead)."""
    _check_parallel(batch_size, rank, world_size)
    task = GeneratedTask(cfg)
    if task.is_state_tracking:
        return []
    batches = []
    for k in range(cfg.val_batches):
        first = (k * world_size + rank) * batch_size
        rows = [task.example("val", i) for i in range(first, first + batch_size)]
        batches.append(pack_rows(rows, cfg.seq_len, task.tokenizer.pad_id))
    return batches
