"""Task streams: prompt masking, determinism, exact resume, data-parallel sharding, config."""

from __future__ import annotations

import json

import pytest
import torch

from looplm.config import load_config
from looplm.config_base import ConfigError
from looplm.data import DataConfig, TrainStream, data_tokenizer, train_stream, validation_batches
from looplm.tasks import CharacterTokenizer, ProgramTokenizer, TaskConfig, TaskStream, program_tokens

TOK = CharacterTokenizer()


def cfg(name: str = "addition", seq_len: int = 20, **task) -> DataConfig:
    task.setdefault("train_length", 5)
    if name == "state_tracking":
        task = {"curriculum": task.get("curriculum", [5, 6])}
    return DataConfig(source=f"task:{name}", seq_len=seq_len, task=task)


def draw(stream, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(stream) for _ in range(count)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


@pytest.mark.parametrize("name", ["copy", "reverse", "addition"])
def test_rows_are_masked_examples(name) -> None:
    stream = train_stream(cfg(name), None, batch_size=32)
    assert isinstance(stream, TaskStream) and stream.tokenizer == TOK
    inputs, targets = next(stream)
    assert inputs.shape == targets.shape == (32, 20) and inputs.dtype == targets.dtype == torch.long
    lengths = set()
    for x, y in zip(inputs.tolist(), targets.tolist()):
        text = TOK.decode(x)
        sep = "=" if name == "addition" else "|"
        prompt, rest = text.split(sep, 1)
        answer = rest.split("\n", 1)[0]
        n = len(prompt.split("+")[0])
        lengths.add(n)
        start = len(prompt)  # inputs[start] is the separator; it predicts the first answer token
        assert all(t == -100 for t in y[:start])  # the prompt carries no loss
        assert TOK.decode(y[start : start + len(answer) + 1]) == answer + "\n"  # answer and newline do
        assert all(t == -100 for t in y[start + len(answer) + 1 :])  # nor does the padding
        assert all(t == TOK.pad_id for t in x[start + 1 + len(answer) :])  # inputs padded with newline
        if name == "addition":
            a, b = prompt.split("+")
            assert int(answer) == int(a) + int(b)
        else:
            assert answer == (prompt if name == "copy" else prompt[::-1])
    assert lengths <= set(range(1, 6)) and len(lengths) >= 4  # input lengths sampled in [1, L_train]


def test_min_length_equal_to_train_length_fixes_the_length() -> None:
    x, _ = next(train_stream(cfg("copy", seq_len=11, min_length=5), None, batch_size=16))
    assert all(TOK.decode(row).index("|") == 5 for row in x.tolist())


@pytest.mark.parametrize("name", ["copy", "addition", "state_tracking"])
def test_seeded_reproducible_and_exactly_resumable(name) -> None:
    c = cfg(name, seq_len=140)
    first = draw(TaskStream(c, batch_size=3), 6)
    assert same(first, draw(TaskStream(c, batch_size=3), 6))
    assert not same(first, draw(TaskStream(c.replace(seed=1), batch_size=3), 6))
    for k in (0, 2, 5):
        stream = TaskStream(c, batch_size=3)
        draw(stream, k)
        state = json.loads(json.dumps(stream.state_dict()))  # JSON-able
        expected = draw(stream, 4)
        fresh = TaskStream(c, batch_size=3)
        fresh.load_state_dict(state)
        assert same(draw(fresh, 4), expected)


@pytest.mark.parametrize("name", ["reverse", "state_tracking"])
def test_data_parallel_ranks_split_the_global_batch(name) -> None:
    c = cfg(name, seq_len=140)
    whole = TaskStream(c, batch_size=6)
    ranks = [TaskStream(c, batch_size=2, rank=r, world_size=3) for r in range(3)]
    for _ in range(4):
        x, y = next(whole)
        parts = [next(r) for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    assert all(r.state_dict() == whole.state_dict() for r in ranks)
    with pytest.raises(ValueError, match="rank=3"):
        TaskStream(c, batch_size=2, rank=3, world_size=3)


def test_validation_batches_are_fixed_held_out_and_sharded() -> None:
    c = cfg("addition").replace(val_batches=3)
    batches = validation_batches(c, None, batch_size=4)
    assert len(batches) == 3 and same(batches, validation_batches(c, None, batch_size=4))
    train_rows = {tuple(r) for x, _ in draw(TaskStream(c, batch_size=4), 3) for r in x.tolist()}
    assert not train_rows & {tuple(r) for x, _ in batches for r in x.tolist()}  # a split of its own
    ranks = [validation_batches(c, None, batch_size=2, rank=r, world_size=2) for r in range(2)]
    assert same([(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*ranks)], batches)
    assert validation_batches(cfg("state_tracking", seq_len=140), None, batch_size=2) == []


def test_state_tracking_rows_supervise_only_the_answers() -> None:
    c = cfg("state_tracking", seq_len=140, curriculum=[5, 6])
    stream = TaskStream(c, batch_size=4)
    tok = stream.tokenizer
    assert isinstance(tok, ProgramTokenizer) and data_tokenizer(c) == tok
    x, y = next(stream)
    assert x.shape == (4, 140)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        supervised = [i for i, t in enumerate(row_y) if t != -100]
        assert len(supervised) == 5  # n = m = 5 answers
        for i in supervised:
            assert tok.word_of(row_x[i]) == "==" and tok.word_of(row_y[i]) in ("0", "1")
            assert row_x[i + 1] == row_y[i]  # teacher forcing: the true answer follows
        assert row_x[program_tokens(5, 5) - 1 :] == [tok.pad_id] * (140 - program_tokens(5, 5) + 1)


def test_task_config_errors() -> None:
    with pytest.raises(ConfigError) as err:
        DataConfig(source="task:multiply")
    assert err.value.field == "data.source" and "task:addition" in str(err.value)
    with pytest.raises(ConfigError, match=r"data.seq_len=20 is invalid: an integer >= 33"):
        DataConfig(source="task:addition", seq_len=20, task={"train_length": 10})
    with pytest.raises(ConfigError, match=r"data.seq_len=20 is invalid: an integer >= 328"):
        DataConfig(source="task:state_tracking", seq_len=20, task={"curriculum": [8, 16]})
    with pytest.raises(ConfigError) as err:
        DataConfig(source="pydoc", task={"train_length": 3})
    assert err.value.field == "data.task"
    with pytest.raises(ConfigError) as err:
        DataConfig(source="task:copy", tokenizer="gpt2.json")
    assert err.value.field == "data.tokenizer"
    bad = [({"train_length": 0}, "data.task.train_length"), ({"min_length": 11}, "data.task.min_length"),
           ({"eval_alphas": []}, "data.task.eval_alphas"), ({"eval_alphas": [1, -2]}, "data.task.eval_alphas"),
           ({"curriculum": [8, 4]}, "data.task.curriculum"), ({"curriculum": [4]}, "data.task.curriculum"),
           ({"advance_at": 1.5}, "data.task.advance_at"), ({"eval_samples": 0}, "data.task.eval_samples"),
           ({"lenght": 3}, "data.task.lenght")]
    for task, field in bad:
        with pytest.raises(ConfigError) as err:
            load_config("tiny-base", ["data.source=task:copy", "data.seq_len=64", f"data.task={json.dumps(task)}"])
        assert err.value.field == field, (task, err.value)


def test_selecting_a_task_from_the_command_line() -> None:
    run = load_config("tiny-base", ["data.source=task:copy", "model.vocab_size=14", "data.task.train_length=7"])
    assert run.data.task == TaskConfig(train_length=7)
    assert load_config("tiny-base", ["data.source=task:copy"]).data.task == TaskConfig()  # defaults
    assert "task" in run.data.to_dict() and load_config("tiny-base").data.task is None
    assert DataConfig.from_dict(run.data.to_dict(), prefix="data") == run.data  # round trip
    for preset, name in [("task-copy", "copy"), ("task-reverse", "reverse"), ("task-addition", "addition"),
                         ("task-state-tracking", "state_tracking")]:
        loaded = load_config(preset)
        assert loaded.data.source == f"task:{name}" and loaded.model.rotary_pct == 1.0
        assert loaded.model.vocab_size == data_tokenizer(loaded.data).vocab_size


def test_eval_lengths_scale_train_length() -> None:
    task = TaskConfig(train_length=10)
    assert [task.eval_length(a) for a in task.eval_alphas] == [10, 15, 20, 30, 50]
    assert TaskConfig(train_length=5).eval_length(1.5) == 8  # rounded half up


def test_text_corpus_stream_is_unchanged() -> None:
    assert isinstance(train_stream(DataConfig(seq_len=32), data_tokenizer(DataConfig()), 2), TrainStream)
