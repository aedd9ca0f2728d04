"""The Trainer on task sources: task metrics in metrics.jsonl, the curriculum, exact resume."""

from __future__ import annotations

import re

import pytest

from looplm.config import RunConfig
from looplm.train import Trainer, read_metrics, train_losses
from looplm.tasks import program_tokens
from tests.train.helpers import assert_same_weights, checkpoint_weights


def run_config(out_dir, source: str, task: dict, seq_len: int, vocab: int, **train) -> RunConfig:
    train_fields = dict(out_dir=str(out_dir), max_steps=4, batch_size=4, lr=3e-3, warmup_steps=1, log_every=1,
                        eval_every=2, save_every=0, sample_tokens=0, device="cpu", precision="fp32")
    train_fields.update(train)
    return RunConfig.from_dict({
        "model": {"vocab_size": vocab, "d_model": 32, "n_heads": 4, "layout": "1R2", "max_seq_len": 256},
        "data": {"source": source, "seq_len": seq_len, "val_batches": 2, "task": task},
        "train": train_fields,
    })


def test_training_on_copy_logs_task_metrics(tmp_path) -> None:
    cfg = run_config(tmp_path, "task:copy", {"train_length": 4, "eval_samples": 6, "eval_alphas": [1, 2]},
                     seq_len=9, vocab=14, sample_tokens=1)
    summary = Trainer(cfg, progress=False).fit()
    events = read_metrics(tmp_path / "metrics.jsonl")
    tasks = [e for e in events if e["event"] == "task_eval"]
    assert [e["step"] for e in tasks] == [2, 4]  # every eval_every steps: tracked over training
    for e in tasks:
        assert e["task"] == "copy" and list(e["alphas"]) == ["1", "2"]
        for alpha, length in (("1", 4), ("2", 8)):
            m = e["alphas"][alpha]
            assert m["length"] == length and m["samples"] == 6
            assert 0.0 <= m["char_acc"] <= 1.0 and len(m["quartile_acc"]) == 4
            assert {"exact_match", "last_char_acc"} <= set(m)
    assert [e["step"] for e in events if e["event"] == "eval"] == [2, 4]  # held-out loss as well
    assert summary["task"] == {k: v for k, v in tasks[-1].items() if k not in ("event", "step", "time")}
    assert summary["val_loss"] is not None and re.match(r"\d{4}\|", summary["sample"])


def test_state_tracking_curriculum_advances_and_resumes_exactly(tmp_path) -> None:
    kw = dict(task={"curriculum": [5, 6, 7], "advance_at": 0.0, "eval_samples": 2}, seq_len=program_tokens(7, 7),
              vocab=271, max_steps=6, eval_every=2, save_every=3)
    summary = Trainer(run_config(tmp_path / "whole", "task:state_tracking", **kw), progress=False).fit()
    assert summary["task"]["n_max"] == 7 and summary["val_loss"] is None  # no fixed held-out split
    Trainer(run_config(tmp_path / "split", "task:state_tracking", **kw), progress=False).fit(stop_after=3)
    Trainer(run_config(tmp_path / "split", "task:state_tracking", **kw), resume=True, progress=False).fit()

    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    tasks = [e for e in whole if e["event"] == "task_eval"]
    # advance_at = 0 passes every scheduled evaluation: stage m = 5 at step 2, 6 at step 4, 7 at step 6.
    assert [(e["step"], e["m"], e["advanced"], e["n_max"]) for e in tasks] == [
        (2, 5, True, 5), (4, 6, True, 6), (6, 7, True, 7)]
    assert tasks[-1]["finished"]
    split_tasks = [e for e in read_metrics(tmp_path / "split" / "metrics.jsonl") if e["event"] == "task_eval"]
    assert [(e["step"], e["advanced"]) for e in split_tasks] == [(2, True), (3, False), (4, True), (6, True)]
    assert train_losses(tmp_path / "split" / "metrics.jsonl") == train_losses(tmp_path / "whole" / "metrics.jsonl")
    assert_same_weights(checkpoint_weights(tmp_path / "whole", 6), checkpoint_weights(tmp_path / "split", 6))


def test_refuses_a_model_too_short_for_the_longest_evaluation(tmp_path) -> None:
    from looplm.config_base import ConfigError

    cfg = run_config(tmp_path, "task:addition", {"train_length": 4}, seq_len=15, vocab=14)
    cfg = RunConfig.from_dict({**cfg.to_dict(), "model": {**cfg.model.to_dict(), "max_seq_len": 32}})
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, progress=False)
    assert err.value.field == "model.max_seq_len" and "data.task.eval_alphas" in str(err.value)
