"""The trainer's public seams: a loss function, a model factory and callbacks, each
through ``Trainer(...)`` only; a stateful callback resumes exactly; bad parts are refused
by name."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopLM
from looplm.config_base import ConfigError
from looplm.train import Callback, Trainer, lm_loss, read_metrics, train_losses
from looplm.train.checkpointer import RESERVED_STATE_KEYS, trainer_state
from tests.train.helpers import assert_same_weights, checkpoint_weights, run_config


HEAD_LOOP = {"kind": "heads", "heads": 2, "max_depth": 2, "layers": 2, "start": 2, "interval": 2}


class Recorder(Callback):
    """Records every hook call as (hook, step)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def on_start(self, trainer, *_):
        self.calls.append(("start", trainer.step))

    def on_step_end(self, trainer, step):
        assert step == trainer.step
        self.calls.append(("step", step))

    def on_eval(self, trainer, step):
        self.calls.append(("eval", step))

    def on_fit_end(self, trainer, summary):
        self.calls.append(("fit_end", trainer.step))
        summary["recorded_steps"] = sum(1 for hook, _ in self.calls if hook == "step")


class WeightNorm(Callback):
    """A stateful callback: the squared weight norm after every step, saved and resumed."""

    state_key = "weight_norms"

    def __init__(self):
        self.norms: list[float] = []

    def on_step_end(self, trainer, step):
        self.norms.append(sum(float(p.detach().pow(2).sum()) for p in trainer.model.parameters()))

    def state_dict(self):
        return {"norms": list(self.norms)}

    def load_state_dict(self, state):
        self.norms = list(state["norms"])


def test_callbacks_are_called_in_order_at_each_point(tmp_path):
    recorder = Recorder()
    trainer = Trainer(run_config(tmp_path / "run", max_steps=5, eval_every=2), callbacks=[recorder], progress=False)
    summary = trainer.fit()
    assert recorder.calls == [("start", 0), ("step", 1), ("step", 2), ("eval", 2), ("step", 3), ("step", 4),
                              ("eval", 4), ("step", 5), ("eval", 5), ("fit_end", 5)]
    assert summary["recorded_steps"] == 5  # on_fit_end fills the summary before it is written
    assert trainer.callbacks[-1] is recorder  # after the trainer's own parts
    # the trainer's own evaluation ran first: its eval records are there at the same steps
    assert [e["step"] for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "eval"] == [2, 4, 5]


def test_a_custom_loss_function_is_minimised_and_logged(tmp_path):
    """A loss that adds a weight penalty to the LM loss: the penalty and the LM term show
    up as aux_ metrics, the logged loss is their sum, and ``step`` is the steps completed."""
    seen_steps: list[int] = []

    def penalised(model, inputs, targets, step):
        seen_steps.append(step)
        lm, aux = lm_loss(model, inputs, targets, step)
        penalty = 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
        return lm + penalty, {**aux, "lm": lm.detach(), "penalty": penalty.detach()}

    Trainer(run_config(tmp_path / "run", max_steps=4, grad_accum=2), loss_fn=penalised, progress=False).fit()
    records = [e for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "train"]
    assert [e["step"] for e in records] == [1, 2, 3, 4]
    for e in records:
        assert e["aux_penalty"] > 0
        assert e["loss"] == pytest.approx(e["aux_lm"] + e["aux_penalty"], rel=1e-6)
    assert seen_steps == [0, 0, 1, 1, 2, 2, 3, 3]  # two micro-batches per step


def test_the_default_loss_is_lm_loss(tmp_path):
    Trainer(run_config(tmp_path / "default", max_steps=3), progress=False).fit()
    Trainer(run_config(tmp_path / "explicit", max_steps=3), loss_fn=lm_loss, progress=False).fit()
    default = train_losses(tmp_path / "default" / "metrics.jsonl")
    assert default == train_losses(tmp_path / "explicit" / "metrics.jsonl") and len(default) == 3


def test_a_model_factory_builds_the_model_before_the_checkpoint_is_restored(tmp_path):
    built = []

    def halved_embedding(cfg):
        model = LoopLM(cfg)
        with torch.no_grad():
            model.embed.weight.mul_(0.5)  # not LoopLM's own init: the factory's
        built.append(model)
        return model

    kw = dict(max_steps=4, save_every=2)
    Trainer(run_config(tmp_path / "whole", **kw), model_factory=halved_embedding, progress=False).fit()
    Trainer(run_config(tmp_path / "split", **kw), model_factory=halved_embedding, progress=False).fit(stop_after=2)
    resumed = Trainer(run_config(tmp_path / "split", **kw), model_factory=halved_embedding, resume=True, progress=False)
    assert resumed.model is built[-1] and resumed.step == 2
    resumed.fit()
    assert train_losses(tmp_path / "split" / "metrics.jsonl") == train_losses(tmp_path / "whole" / "metrics.jsonl")
    assert_same_weights(checkpoint_weights(tmp_path / "whole", 4), checkpoint_weights(tmp_path / "split", 4))


def test_a_stateful_callback_resumes_exactly(tmp_path):
    kw = dict(topology="gated_residual", max_steps=6, save_every=3)
    whole = WeightNorm()
    Trainer(run_config(tmp_path / "whole", **kw), callbacks=[whole], progress=False).fit()
    Trainer(run_config(tmp_path / "split", **kw), callbacks=[WeightNorm()], progress=False).fit(stop_after=3)
    saved = torch.load(tmp_path / "split" / "checkpoints" / "step_0000003" / "trainer.pt", weights_only=True)
    assert saved["weight_norms"] == {"norms": whole.norms[:3]}
    resumed = WeightNorm()
    trainer = Trainer(run_config(tmp_path / "split", **kw), callbacks=[resumed], resume=True, progress=False)
    assert resumed.norms == whole.norms[:3]  # restored before the first step of the continuation
    trainer.fit()
    assert resumed.norms == whole.norms and len(whole.norms) == 6
    # a callback that only observes changes nothing that is computed
    Trainer(run_config(tmp_path / "bare", **kw), progress=False).fit()
    assert train_losses(tmp_path / "whole" / "metrics.jsonl") == train_losses(tmp_path / "bare" / "metrics.jsonl")


def test_the_reserved_keys_cover_trainer_pt(tmp_path):
    """Growth's key included: a callback cannot overwrite what the trainer saves."""
    trainer = Trainer(run_config(tmp_path / "run", model={"head_loop": HEAD_LOOP}), progress=False)
    state = trainer_state(trainer)
    assert "growth" in state and set(state) | {"format", "step", "optimizer"} <= RESERVED_STATE_KEYS


class Keyed(Callback):
    def __init__(self, key):
        self.state_key = key


@pytest.mark.parametrize("kwargs, field, value", [
    (dict(callbacks=[Recorder(), object()]), "callbacks[1]", None),
    (dict(callbacks=[Keyed("rng")]), "callbacks[0].state_key", "rng"),
    (dict(callbacks=[Keyed("growth")]), "callbacks[0].state_key", "growth"),
    (dict(callbacks=[Keyed("mine"), Keyed("mine")]), "callbacks[1].state_key", "mine"),
    (dict(loss_fn="lm"), "loss_fn", "lm"),
    (dict(model_factory=None), "model_factory", None),
])
def test_bad_parts_are_refused_by_name(tmp_path, kwargs, field, value):
    with pytest.raises(ConfigError) as info:
        Trainer(run_config(tmp_path / "run"), progress=False, **kwargs)
    assert info.value.field == field
    if value is not None:
        assert info.value.value == value
    assert not (tmp_path / "run").exists()  # refused before any work
