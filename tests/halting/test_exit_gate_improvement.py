"""Ouro's Stage II (the exit gate's ``objective: improvement``): the labels and the loss
against a hand computation from the model's own per-step states; gradients reach the gate
alone (the LM frozen); the FLOP count runs the frozen LM forward once, with no backward;
the trainer updates the gate only and resumes exactly; refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looplm import LoopLM
from looplm.accounting import count_flops
from looplm.config_base import ConfigError
from looplm.train import Trainer, train_losses
from tests.conftest import random_ids, tiny_config
from tests.halting.test_exit_gate import OURO_AXES, per_step
from tests.train.helpers import assert_same_weights, checkpoint_weights, run_config

STAGE_II = {"kind": "exit_gate", "objective": "improvement"}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def stage_two(layout: str = "2R4", **halting) -> LoopLM:
    """A tiny Ouro-shaped loop under Stage II, init_std 0.3 so the per-step losses differ by
    more than γ at some positions and less at others."""
    return LoopLM(tiny_config("base", layout=layout, init_std=0.3, **OURO_AXES, halting={**STAGE_II, **halting}))


def test_loss_is_the_bce_of_each_gate_against_the_next_steps_improvement_by_hand():
    model = stage_two(improvement_slope=50.0, improvement_threshold=0.005)
    x, y = random_ids(2, 11), random_ids(2, 11, seed=1)
    y[0, :3] = -100  # ignored positions carry no label
    out = model(x, y)
    with torch.no_grad():
        logits, lam = per_step(model, x)
    losses = [F.cross_entropy(z.transpose(1, 2), y, ignore_index=-100, reduction="none") for z in logits]  # L^(t)
    mask = y != -100
    terms = []
    for t in range(len(logits) - 1):  # the last step's λ decides nothing: no label
        improvement = (losses[t] - losses[t + 1]).clamp_min(0.0)  # I^(t) = max(0, L^(t) − L^(t+1))
        w = torch.sigmoid(50.0 * (improvement - 0.005))
        bce = -(w * torch.log(1 - lam[t]) + (1 - w) * torch.log(lam[t]))  # BCE(1 − λ_t, w)
        terms.append(bce[mask])
        if t == 0:
            assert 0.05 < w[mask].mean() < 0.95, "not vacuous: some positions keep improving, some do not"
    expected = torch.cat(terms).mean()
    torch.testing.assert_close(out.aux_losses["exit_improvement"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)  # the BCE alone is the loss
    assert out.lm_loss is not None and set(out.aux_losses) == {"exit_improvement"}


def test_gradients_reach_the_gate_alone():
    model = stage_two()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"halting.gate.weight", "halting.gate.bias"}
    model(random_ids(2, 9), random_ids(2, 9, seed=1)).loss.backward()
    for name, param in model.named_parameters():
        if name in trainable:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_the_frozen_lm_is_counted_forward_once_and_the_gate_with_its_backward():
    """training = the forward given targets (the frozen LM, the per-step label heads) once,
    plus the weight gradient of every gate a label reads (all but the last step's: its λ
    gets none), 1 × its forward; Stage I backpropagates through everything."""
    report = count_flops(stage_two(), 16)
    gates = [report.steps[f"halting.{t}"] for t in range(4)]
    assert min(gates) > 0 and report.weights_only == sum(gates[:-1])
    assert report.training == pytest.approx(report.forward_with_targets + sum(gates[:-1]), rel=1e-12)
    stage_one = count_flops(LoopLM(tiny_config("base", layout="2R4", **OURO_AXES,
                                               halting={**STAGE_II, "objective": "expected"})), 16)
    assert stage_one.forward == report.forward and stage_one.training > 2 * report.training


def test_stage_two_trains_the_gate_only_and_resumes_exactly(tmp_path):
    model = {"layout": "2R2", **OURO_AXES, "halting": {**STAGE_II, "threshold": 0.5}}
    kw = dict(model=model, max_steps=4, save_every=2)
    Trainer(run_config(tmp_path / "whole", **kw), progress=False).fit()
    Trainer(run_config(tmp_path / "split", **kw), progress=False).fit(stop_after=2)
    Trainer(run_config(tmp_path / "split", **kw), resume=True, progress=False).fit()
    assert train_losses(tmp_path / "split" / "metrics.jsonl") == train_losses(tmp_path / "whole" / "metrics.jsonl")
    start, end = checkpoint_weights(tmp_path / "whole", 2), checkpoint_weights(tmp_path / "whole", 4)
    assert_same_weights(end, checkpoint_weights(tmp_path / "split", 4))
    moved = {name for name in end if not torch.equal(start[name], end[name])}
    assert moved == {"halting.gate.weight", "halting.gate.bias"}


@pytest.mark.parametrize("model,field", [
    (dict(layout="2R1", halting=STAGE_II), "model.layout"),  # one step: nothing to compare against
    (dict(layout="1+1R3+1", halting=STAGE_II), "model.layout"),  # the labels read logits straight from the loop
    (dict(layout="2R3", halting={**STAGE_II, "improvement_slope": 0.0}), "model.halting.improvement_slope"),
    (dict(layout="2R3", halting={**STAGE_II, "improvement_threshold": -0.1}), "model.halting.improvement_threshold"),
])
def test_bad_stage_two_settings_are_refused_naming_the_field(model, field):
    with pytest.raises(ConfigError, match=field):
        tiny_config("base", **OURO_AXES, **model)


def test_stage_two_starts_from_a_stage_one_run_and_keeps_its_lm(tmp_path):
    """train.init_from takes a Stage I checkpoint although the objective differs (the
    exit gate's weight-free fields); another difference is still refused."""
    stage_one = {"layout": "2R2", **OURO_AXES, "halting": {"kind": "exit_gate", "objective": "expected"}}
    Trainer(run_config(tmp_path / "one", model=stage_one, max_steps=2, save_every=2), progress=False).fit()
    two = {**stage_one, "halting": {**STAGE_II, "improvement_threshold": 0.01}}
    Trainer(run_config(tmp_path / "two", model=two, max_steps=2, save_every=2,
                       init_from=str(tmp_path / "one")), progress=False).fit()
    before, after = checkpoint_weights(tmp_path / "one", 2), checkpoint_weights(tmp_path / "two", 2)
    assert {name for name in after if not torch.equal(before[name], after[name])} == {
        "halting.gate.weight", "halting.gate.bias"}
    with pytest.raises(ConfigError, match="model.d_model"):
        Trainer(run_config(tmp_path / "wide", model={**two, "d_model": 64}, init_from=str(tmp_path / "one")),
                progress=False)
