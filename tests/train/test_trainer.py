"""Trainer: exact resume, non-finite steps, metrics and summary, refusals."""

from __future__ import annotations

import json
import logging
import math
import random

import pytest
import torch

from looplm import LoopLM
from looplm.config_base import ConfigError
from looplm.train import CheckpointError, Trainer, parameter_counts, read_metrics, train_losses
from tests.train.helpers import assert_same_weights, checkpoint_weights, run_config


class Crash(Exception):
    """Stands in for a job killed mid-run."""


# ---------------------------------------------------------------------- resume
TOPOLOGIES = ["base", "residual", "anchor", "anchor_embedding", "gated_residual", "static_combination",
              "dynamic_combination", "mesh"]
RESUME_GRID = (
    [(kind, {}, 1) for kind in TOPOLOGIES]
    + [("mesh", {}, 2), ("base", {"layout": "3"}, 1), ("mesh", {"share_core": False}, 1),
       ("additive", {"topology": {"kind": "additive", "supplements": ["anchor", "anchor_embedding"]}}, 1),
       # the ladder's axes: adaptive ACT with its ponder cost, nested streams with Q-halt's BCE
       ("base", {"layout": "1R3", "step_embeddings": True, "halting": {"kind": "act", "ponder_cost": 0.1}}, 1),
       ("base", {"layout": "1R2", "streams": {"kind": "two", "outer": 2, "inner": 1, "no_grad_cycles": True,
                                                "init": "random"},
                 "halting": {"kind": "qhalt"}, "position": "learned"}, 2),
       # Ouro's axes: sandwich norms, the loop-input norm, the exit gate's readout and its
       # Stage I objective (expected loss under the exit distribution, entropy bonus)
       ("base", {"layout": "2R2", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "norm_placement": "sandwich",
                 "loop_input_norm": True, "halting": {"kind": "exit_gate", "threshold": 0.5,
                                                      "objective": "expected"}}, 1),
       # per-iteration LoRA on the shared core (Relaxed Recursive Transformers)
       ("anchor", {"layout": "1+1R3+1", "lora": {"rank": 2}}, 2),
       # Huginn: random s_0 from the saved RNG, a count drawn from (seed, step), truncated backprop
       ("concat_adapter", {"layout": "1+1R3+1", "depth": {"kind": "lognormal_poisson", "backprop_window": 2}}, 2),
       # mixture-of-experts FFNs: routers and experts (shared; per iteration) and their aux losses
       ("mesh", {"mlp": "swiglu", "moe": {"experts": 4, "top_k": 2, "z_loss_weight": 0.001}}, 2),
       ("base", {"moe": {"experts": 3, "top_k": 1, "per_iteration": True}}, 1)]
)


@pytest.mark.parametrize(
    "topology,model,grad_accum", RESUME_GRID,
    ids=[f"{k}-{'-'.join(str(v) for v in m.values() if not isinstance(v, dict)) or 'shared'}-{len(m)}-accum{a}"
         for k, m, a in RESUME_GRID],
)
def test_resumed_run_matches_uninterrupted_run_step_for_step(tmp_path, topology, model, grad_accum):
    kw = dict(topology=topology, model=model, grad_accum=grad_accum, max_steps=6, save_every=3)
    Trainer(run_config(tmp_path / "whole", **kw), progress=False).fit()
    Trainer(run_config(tmp_path / "split", **kw), progress=False).fit(stop_after=3)
    assert sorted(train_losses(tmp_path / "split" / "metrics.jsonl")) == [1, 2, 3]
    resumed = Trainer(run_config(tmp_path / "split", **kw), resume=True, progress=False)
    assert resumed.step == 3 and resumed.tokens_seen == 3 * 4 * 32
    resumed.fit()

    whole = train_losses(tmp_path / "whole" / "metrics.jsonl")
    split = train_losses(tmp_path / "split" / "metrics.jsonl")
    assert sorted(whole) == list(range(1, 7))
    assert split == whole  # bit-exact floats, every step
    assert_same_weights(checkpoint_weights(tmp_path / "whole", 6), checkpoint_weights(tmp_path / "split", 6))
    assert [e["event"] for e in read_metrics(tmp_path / "split" / "metrics.jsonl")].count("resume") == 1


def test_resume_after_a_crash_replays_the_lost_steps_exactly(tmp_path, monkeypatch):
    kw = dict(topology="gated_residual", max_steps=6, save_every=2, eval_every=2)
    Trainer(run_config(tmp_path / "whole", **kw), progress=False).fit()

    real_step = Trainer._train_step

    def crashing_step(self, lr):
        if self.step == 4:  # checkpoints at steps 2 and 4; the job dies in step 5
            raise Crash
        return real_step(self, lr)

    monkeypatch.setattr(Trainer, "_train_step", crashing_step)
    with pytest.raises(Crash):
        Trainer(run_config(tmp_path / "crashed", **kw), progress=False).fit()
    monkeypatch.undo()
    assert (tmp_path / "crashed" / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    Trainer(run_config(tmp_path / "crashed", **kw), resume=True, progress=False).fit()
    whole = train_losses(tmp_path / "whole" / "metrics.jsonl")
    assert train_losses(tmp_path / "crashed" / "metrics.jsonl") == whole
    evals = [e for e in read_metrics(tmp_path / "crashed" / "metrics.jsonl") if e["event"] == "eval"]
    whole_evals = [e for e in read_metrics(tmp_path / "whole" / "metrics.jsonl") if e["event"] == "eval"]
    assert [(e["step"], e["val_loss"]) for e in evals] == [(e["step"], e["val_loss"]) for e in whole_evals]
    assert_same_weights(checkpoint_weights(tmp_path / "whole", 6), checkpoint_weights(tmp_path / "crashed", 6))


def test_resume_from_an_explicit_step_directory(tmp_path):
    kw = dict(max_steps=4, save_every=2)
    Trainer(run_config(tmp_path / "run", **kw), progress=False).fit()
    step2 = tmp_path / "run" / "checkpoints" / "step_0000002"
    saved = torch.load(step2 / "trainer.pt", weights_only=True)
    random.seed(123)
    trainer = Trainer(run_config(tmp_path / "run", **kw), resume=str(step2), progress=False)
    assert trainer.step == 2 and trainer.resumed_from == step2
    assert trainer.stream.state_dict() == saved["data"]
    assert torch.equal(torch.get_rng_state(), saved["rng"]["torch"])  # RNG restored after model init
    assert random.getstate()[1] == tuple(saved["rng"]["python"][1])


def test_bf16_autocast_on_cpu(tmp_path):
    summary = Trainer(run_config(tmp_path / "run", max_steps=2, precision="bf16"), progress=False).fit()
    assert summary["precision"] == "bf16" and math.isfinite(summary["train_loss"])
    assert math.isfinite(summary["val_loss"])


# ---------------------------------------------------------------------- refusals
def test_fresh_run_into_a_directory_with_checkpoints_is_refused(tmp_path):
    cfg = run_config(tmp_path / "run", max_steps=2)
    Trainer(cfg, progress=False).fit()
    with pytest.raises(ConfigError, match=r"train.out_dir.*already holds a run's checkpoints.*resume=True"):
        Trainer(cfg, progress=False)
    # a finished run resumed does no more steps and keeps its checkpoint
    summary = Trainer(cfg, resume=True, progress=False).fit()
    assert summary["steps"] == 2 and summary["checkpoint"].endswith("step_0000002")


def test_resume_without_a_checkpoint(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="looplm"):
        trainer = Trainer(run_config(tmp_path / "new"), resume=True, progress=False)
    assert trainer.step == 0 and "starting a fresh run" in caplog.text
    with pytest.raises(CheckpointError, match="does not exist"):
        Trainer(run_config(tmp_path / "new2"), resume=str(tmp_path / "missing"), progress=False)


def test_resume_with_another_model_is_refused(tmp_path):
    Trainer(run_config(tmp_path / "run", max_steps=2), progress=False).fit()
    with pytest.raises(CheckpointError, match="model.layout: checkpoint '1\\+1R2\\+1', this run '1\\+1R3\\+1'"):
        Trainer(run_config(tmp_path / "run", model={"layout": "1+1R3+1"}), resume=True, progress=False)


def test_resume_on_other_data_is_refused(tmp_path, monkeypatch):
    """Each session records what identifies its tokens (looplm.data.identity); a run is not
    continued where the corpus or tokenizer differ (another machine's Python), and is where
    they are the same."""
    import looplm.train.trainer as trainer_module

    cfg = run_config(tmp_path / "run", max_steps=4, save_every=2)
    Trainer(cfg, progress=False).fit(stop_after=2)
    (start,) = [e for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "start"]
    assert len(start["data"]["corpus"]) == 32 and start["data"]["tokenizer"] is None  # pydoc in bytes
    real = trainer_module.data_identity
    monkeypatch.setattr(trainer_module, "data_identity", lambda data, tokenizer: {"corpus": "0" * 32, "tokenizer": None})
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, resume=True, progress=False)
    assert err.value.field == "data.source" and f"the corpus: recorded {start['data']['corpus']}, here {'0' * 32}" in str(err.value)
    monkeypatch.setattr(trainer_module, "data_identity", real)
    Trainer(cfg, resume=True, progress=False).fit()
    sessions = [e["data"] for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] in ("start", "resume")]
    assert sessions == [start["data"]] * 2


def test_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model.vocab_size=200 .*>= 257"):
        Trainer(run_config(tmp_path / "run", model={"vocab_size": 200}), progress=False)


# ---------------------------------------------------------------------- non-finite steps
def nan_loss_at(monkeypatch, bad_calls):
    """Make the training forward calls numbered in ``bad_calls`` (1-based) return a NaN loss."""
    real_forward = LoopLM.forward
    calls = {"n": 0}

    def forward(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        if self.training:
            calls["n"] += 1
            if calls["n"] in bad_calls:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(LoopLM, "forward", forward)


def test_non_finite_step_is_skipped_and_training_continues(tmp_path, monkeypatch, caplog):
    nan_loss_at(monkeypatch, {3})
    cfg = run_config(tmp_path / "run", max_steps=5, save_every=1)
    with caplog.at_level(logging.WARNING, logger="looplm"):
        summary = Trainer(cfg, progress=False).fit()
    assert "step 3 skipped" in caplog.text
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    skipped = [e for e in events if e["event"] == "skipped"]
    assert [(e["step"], e["loss"], e["bad_steps"]) for e in skipped] == [(3, "nan", 1)]
    assert sorted(train_losses(tmp_path / "run" / "metrics.jsonl")) == [1, 2, 4, 5]
    assert all(math.isfinite(v) for v in train_losses(tmp_path / "run" / "metrics.jsonl").values())
    assert summary["skipped_steps"] == 1 and summary["steps"] == 5
    # the skipped step changed nothing; the steps around it did
    assert_same_weights(checkpoint_weights(tmp_path / "run", 2), checkpoint_weights(tmp_path / "run", 3))
    w3, w4 = checkpoint_weights(tmp_path / "run", 3), checkpoint_weights(tmp_path / "run", 4)
    assert not torch.equal(w3["embed.weight"], w4["embed.weight"])


def test_persistent_non_finite_loss_stops_the_run(tmp_path, monkeypatch):
    nan_loss_at(monkeypatch, set(range(2, 100)))
    cfg = run_config(tmp_path / "run", max_steps=10, max_bad_steps=3)
    with pytest.raises(RuntimeError, match=r"3 consecutive steps \(2..4\).*non-finite.*lower train.lr"):
        Trainer(cfg, progress=False).fit()
    skipped = [e["step"] for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "skipped"]
    assert skipped == [2, 3, 4]


# ---------------------------------------------------------------------- records
def test_metrics_and_summary(tmp_path):
    cfg = run_config(tmp_path / "run", max_steps=4, eval_every=2, log_every=2, sample_tokens=4, sample_prompt="def ")
    trainer = Trainer(cfg, progress=False)
    summary = trainer.fit()
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert events[0]["event"] == "start" and events[0]["parameters"] == parameter_counts(trainer.model)
    train = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in train] == [2, 4]
    for e in train:
        assert {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "time"} <= set(e)
        assert e["tokens"] == e["step"] * 4 * 32 and e["tokens_per_s"] > 0
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4]  # eval_every, and not twice at the end
    for e in evals:
        assert e["val_ppl"] == pytest.approx(math.exp(e["val_loss"]), rel=1e-12)

    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for key in ("parameters", "unrolled_depth", "tokens_seen", "train_loss", "train_ppl", "val_loss", "val_ppl",
                "tokens_per_s", "wall_time_s", "sample", "checkpoint", "steps"):
        assert key in summary
    assert summary["parameters"] == parameter_counts(trainer.model)
    assert summary["parameters"]["non_embedding"] < summary["parameters"]["total"]
    assert summary["unrolled_depth"] == 1 + 1 * 2 + 1
    assert summary["tokens_seen"] == 4 * 4 * 32 and summary["steps"] == 4
    assert summary["val_loss"] == evals[-1]["val_loss"]
    assert summary["val_ppl"] == pytest.approx(math.exp(summary["val_loss"]), rel=1e-12)
    assert summary["train_loss"] == train[-1]["loss"]
    assert summary["train_ppl"] == pytest.approx(math.exp(summary["train_loss"]), rel=1e-12)
    assert isinstance(summary["sample"], str) and summary["sample"].startswith("def ")
    assert summary["checkpoint"].endswith("step_0000004")


def test_auxiliary_losses_are_logged_beside_the_loss(tmp_path):
    """ACT's ponder cost (and any other auxiliary term) goes to metrics.jsonl as aux_NAME,
    averaged over micro-batches, and is part of the logged loss."""
    cfg = run_config(tmp_path, model={"layout": "1R3", "halting": {"kind": "act", "ponder_cost": 0.05}},
                     max_steps=2, grad_accum=2)
    Trainer(cfg, progress=False).fit()
    events = [e for e in read_metrics(tmp_path / "metrics.jsonl") if e["event"] == "train"]
    assert len(events) == 2
    for event in events:
        assert 0.05 <= event["aux_ponder"] <= 0.05 * 4  # ρ = N + R lies in [1, T + 1]
        assert event["loss"] > event["aux_ponder"]


def test_fields_added_since_a_checkpoint_take_their_defaults_when_comparing():
    """A run saved before a config field existed resumes: the missing field is read as its
    default, while a field that really differs is still reported."""
    from looplm.model_config import ModelConfig
    from looplm.train.checkpoint import config_differences, with_defaults

    current = ModelConfig(d_model=32, n_heads=4, layout="1R2")
    saved = current.to_dict()
    del saved["halting"], saved["step_embeddings"]  # an older looplm wrote neither
    assert config_differences(with_defaults(saved, ModelConfig, "model"), current.to_dict(), "model") == []
    assert config_differences(saved, current.to_dict(), "model")  # the raw comparison would refuse
    saved["d_model"] = 64
    assert config_differences(with_defaults(saved, ModelConfig, "model"), current.to_dict(), "model") == [
        "model.d_model: checkpoint 64, this run 32"]
    assert with_defaults({"d_model": "wide"}, ModelConfig, "model") == {"d_model": "wide"}  # unparsable: as saved


def test_a_training_step_reads_nothing_back(tmp_path):
    """The fused AdamW kernel skips a non-finite step on the device: a step has no host
    sync; fit reads the steps back at log, evaluation and checkpoint steps only."""
    from looplm.accounting.dispatch import count_dispatch

    trainer = Trainer(run_config(tmp_path / "run", max_steps=4), progress=False)
    trainer._train_step(1e-3)  # first step: the optimiser's state is created
    counts, (values, names) = count_dispatch(lambda: trainer._train_step(1e-3))
    assert counts.syncs == 0, counts.by_op
    assert values.shape == (2 + len(names),) and torch.isfinite(values).all()


def test_a_non_finite_step_between_reads_applies_no_update(tmp_path, monkeypatch):
    nan_loss_at(monkeypatch, {2})
    trainer = Trainer(run_config(tmp_path / "run", max_steps=4, log_every=4), progress=False)
    summary = trainer.fit()
    skipped = [e for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "skipped"]
    assert [(e["step"], e["bad_steps"]) for e in skipped] == [(2, 1)]  # read back at step 4
    assert summary["skipped_steps"] == 1
    steps = {int(s["step"]) for group in trainer.optimizer.param_groups for s in
             (trainer.optimizer.state[p] for p in group["params"]) if s}
    assert steps == {3}  # four steps, one of them skipped on the device
