"""train.loggers: TensorBoard and Weights & Biases (offline) receive the scalars of metrics.jsonl."""

from __future__ import annotations

import pytest

from looplm import load_config
from looplm.config_base import ConfigError
from looplm.train import Trainer, read_metrics
from looplm.train.trackers import scalars

SMALL = ["model.d_model=32", "data.seq_len=32", "train.batch_size=4", "train.sample_tokens=0", "data.val_batches=1",
         "train.max_steps=4", "train.log_every=2", "train.eval_every=2", "train.save_every=0"]


def test_scalars_keep_finite_numbers_only():
    assert scalars("train", {"loss": 2.5, "lr": 1e-3, "name": "x", "flag": True, "bad": float("nan"), "n": 3}) == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/n": 3.0}


def test_tensorboard_receives_the_jsonl_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    cfg = load_config("tiny-mesh", [f"train.out_dir={run}", *SMALL, "train.loggers=[jsonl, tensorboard]"])
    Trainer(cfg, progress=False).fit()
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    logged = {e["step"]: e["loss"] for e in read_metrics(run / "metrics.jsonl") if e["event"] == "train"}
    board = {s.step: s.value for s in events.Scalars("train/loss")}
    assert board.keys() == logged.keys() == {2, 4}
    assert all(board[k] == pytest.approx(logged[k], rel=1e-6) for k in logged)
    val = [e["val_loss"] for e in read_metrics(run / "metrics.jsonl") if e["event"] == "eval"]
    assert [s.value for s in events.Scalars("eval/val_loss")] == pytest.approx(val, rel=1e-6)
    assert "train/tokens_per_s" in events.Tags()["scalars"]


def test_wandb_offline_run_is_written_without_a_network(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from wandb.sdk.wandb_run import Run

    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, original = [], Run.log

    def spy(self, data, *args, **kwargs):  # what reaches wandb, then wandb's own logging
        logged.append(dict(data))
        return original(self, data, *args, **kwargs)

    monkeypatch.setattr(Run, "log", spy)
    run = tmp_path / "run"
    cfg = load_config("tiny-mesh", [f"train.out_dir={run}", *SMALL, "train.loggers=[wandb]"])
    Trainer(cfg, progress=False).fit()
    assert wandb.run is None  # finished when training ended
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    jsonl = {e["step"]: e["loss"] for e in read_metrics(run / "metrics.jsonl") if e["event"] == "train"}
    sent = {d["step"]: d["train/loss"] for d in logged if "train/loss" in d}
    assert sent.keys() == jsonl.keys() == {2, 4}
    assert all(sent[k] == pytest.approx(jsonl[k], rel=1e-6) for k in jsonl)


@pytest.mark.parametrize("loggers", ["[mlflow]", "[jsonl, jsonl]"])
def test_unknown_or_repeated_loggers_are_refused(loggers):
    with pytest.raises(ConfigError, match="train.loggers"):
        load_config("tiny-mesh", [f"train.loggers={loggers}"])


def test_train_events_carry_throughput_and_mfu_where_the_peak_is_known(tmp_path, monkeypatch):
    import looplm.accounting

    monkeypatch.setattr(looplm.accounting, "device_peak_flops", lambda device, dtype: 1e12)  # a known device
    run = tmp_path / "run"
    summary = Trainer(load_config("tiny-mesh", [f"train.out_dir={run}", *SMALL]), progress=False).fit()
    train = [e for e in read_metrics(run / "metrics.jsonl") if e["event"] == "train"]
    per_token = summary["model_flops_per_token"]
    assert per_token > 0 and [e["step"] for e in train] == [2, 4]
    for e in train:
        assert e["tokens_per_s"] > 0 and e["mfu"] == pytest.approx(per_token * e["tokens_per_s"] / 1e12)
    assert summary["mfu"] == pytest.approx(per_token * summary["tokens_per_s"] / 1e12)


def test_progress_bar_shows_tokens_per_second_and_eta(tmp_path, capsys):
    import re

    cfg = load_config("tiny-mesh", [f"train.out_dir={tmp_path / 'run'}", *SMALL])
    Trainer(cfg, progress=True).fit()
    err = capsys.readouterr().err
    assert "tok_s=" in err and "loss=" in err
    assert re.search(r"\d\d:\d\d<\d\d:\d\d", err), err[-500:]  # elapsed<remaining: tqdm's ETA
