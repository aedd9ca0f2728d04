"""Task evaluation: greedy decoding on fixed out-of-distribution sets, and the Trainer's hook.

Character tasks (autoregressive-TRM App. B.3): for each α in ``data.task.eval_alphas`` a
fixed set of ``eval_samples`` problems at input length L_eval = α·L_train (seeded by
``data.seed`` and the length, the same at every evaluation; at L_eval <= L_train drawn
from the held-out problems training never sees, ``data.task.heldout``, and reported
beside ``seen``: the same metrics on training problems of length L_train), answered by greedy decoding
through the model's cache (``LoopLM.generate``, temperature 0) that stops at the newline
token after at most ``len(answer) + 1`` tokens; scored by :mod:`looplm.tasks.metrics`.

State tracking (LT2 §4.6): a fixed set of programs at the current curriculum stage n = m;
every answer token is predicted from the true program before it (teacher forcing, one
forward pass: the answers are single tokens, so this is greedy decoding of each answer);
accuracy is over all answer tokens (argmax over the whole vocabulary).

Under data parallelism each rank scores every ``world_size``-th sample and the integer
counts are summed across ranks, so every rank gets the same metrics (and the same
curriculum decision).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from looplm.config_base import ConfigError
from looplm.tasks.character import example_tokens
from looplm.tasks.config import is_task_source, task_name
from looplm.tasks.metrics import CharacterScores
from looplm.tasks.state_tracking import program_tokens
from looplm.tasks.stream import IGNORE_INDEX, GeneratedTask, TaskStream, pack_rows

if TYPE_CHECKING:
    from looplm.config import RunConfig
    from looplm.data.config import DataConfig
    from looplm.model import LoopLM

logger = logging.getLogger("looplm")


def _device(model: "LoopLM") -> torch.device:
    return next(model.parameters()).device


def _sum_across_ranks(counts: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    return counts


def longest_eval_tokens(cfg: "DataConfig", stage: Optional[int] = None) -> int:
    """Tokens of the longest evaluation sequence (prompt, answer, terminator); for state
    tracking at stage ``stage`` (default: the last stage of the curriculum)."""
    name, task = task_name(cfg.source), cfg.task
    if name == "state_tracking":
        m = max(task.curriculum) if stage is None else stage
        return program_tokens(m, m)
    return max(example_tokens(name, task.eval_length(a)) for a in task.eval_alphas)


def check_fits(max_seq_len: int, cfg: "DataConfig", stage: Optional[int] = None) -> None:
    """Refuse a model whose ``max_seq_len`` cannot hold the task's longest evaluation sequence."""
    need = longest_eval_tokens(cfg, stage)
    if need > max_seq_len:
        field = "data.task.curriculum" if task_name(cfg.source) == "state_tracking" else "data.task.eval_alphas"
        raise ConfigError(
            "model.max_seq_len", max_seq_len,
            f"an integer >= {need}: the longest evaluation sequence of {cfg.source} ({field}) has {need} tokens",
        )


def decode_answer(tokens: list[int], eos_id: int, decode) -> str:
    """The generated characters before the first ``eos_id`` (all of them when none came)."""
    if eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id)]
    return decode(tokens)


@torch.no_grad()
def evaluate_task(
    model: "LoopLM", cfg: "DataConfig", *, stage: Optional[int] = None, rank: int = 0, world_size: int = 1,
) -> dict[str, Any]:
    """Metrics of ``model`` on the task of ``cfg`` (a ``DataConfig`` with ``source=task:NAME``).

    Character tasks: ``{"task", "train_length", "alphas": {"1": {"alpha", "length",
    "exact_match", "char_acc", "quartile_acc": [Q1..Q4], "last_char_acc", "samples"}, "1.5":
    …}, "heldout", "seen": {"length", "exact_match", …}}`` (``seen`` only with ``heldout > 0``). State tracking (at stage n = m ``stage``, default the first of the curriculum):
    ``{"task", "m", "n", "samples", "answers", "accuracy", "program_acc", "loss"}``.
    ``rank`` / ``world_size``: score this rank's share and sum the counts over the process group.
    """
    if not is_task_source(cfg.source):
        raise ValueError(f"data.source={cfg.source!r} is not a task source (task:NAME)")
    task = GeneratedTask(cfg)
    if task.is_state_tracking:
        m = cfg.task.curriculum[0] if stage is None else stage
        check_fits(model.cfg.max_seq_len, cfg, m)
        return _evaluate_state_tracking(model, task, m, rank, world_size)
    check_fits(model.cfg.max_seq_len, cfg)
    return _evaluate_characters(model, task, rank, world_size)


def _evaluate_characters(model: "LoopLM", task: GeneratedTask, rank: int, world_size: int) -> dict[str, Any]:
    tc = task.cfg
    results: dict[str, Any] = {}
    for alpha in tc.eval_alphas:
        n = tc.eval_length(alpha)
        problems = [task.problem(f"eval:{n}", i, n) for i in range(rank, tc.eval_samples, world_size)]
        results[f"{alpha:g}"] = {"alpha": alpha, "length": n, **_score(model, task, problems, world_size)}
    record = {"task": task.name, "train_length": tc.train_length, "heldout": tc.heldout, "alphas": results}
    if tc.heldout > 0:  # the held-out scores beside the same metrics on problems training drew
        seen = task.seen_problems(tc.eval_samples)[rank::world_size]
        record["seen"] = {"length": tc.train_length, **_score(model, task, seen, world_size)}
    return record


def _score(model: "LoopLM", task: GeneratedTask, problems: list, world_size: int) -> dict[str, Any]:
    """Greedy answers to ``problems`` (this rank's share), scored and summed over the ranks."""
    tc, tok = task.cfg, task.tokenizer
    scores = CharacterScores()
    for start in range(0, len(problems), tc.eval_batch_size):
        batch = problems[start : start + tc.eval_batch_size]
        out = model.generate(
            [tok.encode(p.prompt) for p in batch],
            max_new_tokens=len(batch[0].answer) + 1,  # the answer and its newline
            temperature=0.0,
            stop_tokens=(tok.eos_id,),
            pad_token_id=tok.pad_id,
        )
        for problem, new in zip(batch, out.new_tokens):
            scores.add(decode_answer(new, tok.eos_id, tok.decode), problem.answer)
    counts = _sum_across_ranks(scores.as_tensor().to(_device(model)), world_size)
    return CharacterScores.from_tensor(counts.cpu()).summary()


def _evaluate_state_tracking(model: "LoopLM", task: GeneratedTask, m: int, rank: int, world_size: int
                             ) -> dict[str, Any]:
    tc, device = task.cfg, _device(model)
    programs = [task.program("eval", i, m) for i in range(rank, tc.eval_samples, world_size)]
    length = program_tokens(m, m) - 1
    correct = total = whole = 0
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(programs), tc.eval_batch_size):
            inputs, targets = pack_rows(programs[start : start + tc.eval_batch_size], length, task.tokenizer.pad_id)
            inputs, targets = inputs.to(device), targets.to(device)
            logits = model(inputs).logits.float()  # [b, length, V]
            mask = targets != IGNORE_INDEX
            hit = (logits.argmax(-1) == targets) & mask
            correct += int(hit.sum())
            total += int(mask.sum())
            whole += int((hit.sum(1) == mask.sum(1)).sum())
            loss_sum += F.cross_entropy(logits[mask], targets[mask], reduction="sum").double()
    finally:
        model.train(was_training)
    counts = _sum_across_ranks(torch.tensor([len(programs), correct, total, whole], device=device), world_size)
    loss_sum = _sum_across_ranks(loss_sum, world_size)
    samples, correct, total, whole = (int(v) for v in counts.tolist())
    return {
        "task": task.name, "m": m, "n": m, "samples": samples, "answers": total,
        "accuracy": correct / total if total else None,
        "program_acc": whole / samples if samples else None,
        "loss": float(loss_sum) / total if total else None,
    }


class TaskEvaluator:
    """The Trainer's hook for a task source: task metrics at every evaluation, and the
    state-tracking curriculum.

    The curriculum advances only at scheduled evaluations (every ``train.eval_every``
    steps, and at ``train.max_steps``), never at the extra evaluation of a run stopped
    early (``fit(stop_after=…)``), so a resumed run advances exactly where the
    uninterrupted one does.
    """

    def __init__(self, run_cfg: "RunConfig", stream: TaskStream, rank: int = 0, world_size: int = 1):
        self.data, self.train = run_cfg.data, run_cfg.train
        self.stream, self.rank, self.world_size = stream, rank, world_size
        self.last: Optional[dict[str, Any]] = None  # the latest record (the run summary's "task")
        check_fits(run_cfg.model.max_seq_len, self.data)  # at construction, not at the first evaluation

    def evaluate(self, model: "LoopLM", step: int) -> dict[str, Any]:
        """Evaluate ``model`` (advancing the curriculum when due); the record for metrics.jsonl."""
        curriculum = self.stream.curriculum
        stage = None if curriculum is None else curriculum.current
        record = evaluate_task(model, self.data, stage=stage, rank=self.rank, world_size=self.world_size)
        self.last = record
        if curriculum is None:
            seen = record.get("seen")
            logger.info("task %s at step %d: %s%s", record["task"], step, ", ".join(
                f"α={k} exact {v['exact_match']:.3f} char {v['char_acc']:.3f}" for k, v in record["alphas"].items()),
                f"; seen exact {seen['exact_match']:.3f}" if seen else "")
            return record
        every = self.train.eval_every
        scheduled = (every > 0 and step % every == 0) or step >= self.train.max_steps
        advanced = scheduled and record["accuracy"] is not None and curriculum.update(record["accuracy"], step)
        record.update(advanced=advanced, n_max=curriculum.n_max, next_m=curriculum.current,
                      finished=curriculum.finished)
        logger.info("task state_tracking at step %d: m=%d accuracy %.3f%s; n_max=%s", step, stage,
                    record["accuracy"] or 0.0, " (passed)" if advanced else "", curriculum.n_max)
        return record

    @torch.no_grad()
    def sample(self, model: "LoopLM") -> str:
        """One evaluation problem answered greedily: the prompt and the model's answer (character
        tasks), or a program at the current stage with the model's answers in place of the true ones."""
        task = self.stream.task
        tok = task.tokenizer
        if self.stream.curriculum is None:
            n = task.cfg.eval_length(task.cfg.eval_alphas[0])
            problem = task.problem(f"eval:{n}", 0, n)
            out = model.generate([tok.encode(problem.prompt)], max_new_tokens=len(problem.answer) + 1,
                                 temperature=0.0, stop_tokens=(tok.eos_id,), pad_token_id=tok.pad_id)
            return problem.prompt + tok.decode(out.new_tokens[0])
        ids, supervised = task.program("eval", 0, self.stream.curriculum.current)
        was_training = model.training
        model.eval()
        try:
            logits = model(torch.tensor([ids[:-1]], device=_device(model))).logits[0]
        finally:
            model.train(was_training)
        predicted = logits.argmax(-1).tolist()
        answered = [predicted[i - 1] if supervised[i] else t for i, t in enumerate(ids)]
        return tok.decode(answered)


def task_evaluator(run_cfg: "RunConfig", stream: Any, rank: int = 0, world_size: int = 1) -> Optional[TaskEvaluator]:
    """A :class:`TaskEvaluator` when the run's data source is a task, else None."""
    if not is_task_source(run_cfg.data.source):
        return None
    return TaskEvaluator(run_cfg, stream, rank, world_size)
