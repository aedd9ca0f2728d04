"""The exit gate's fixed exit step and Ouro's Stage I objective (expected task loss under
the exit distribution minus an entropy bonus), checked against a hand computation from the
model's own per-step states; the loss goes through the model's loss path; refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looplm import LoopLM
from looplm.config_base import ConfigError
from tests.conftest import random_ids, tiny_config
from tests.invariants import assert_decodes_like_full_forward, prefill_then_tokens

OURO_AXES = dict(norm="rmsnorm", mlp="swiglu", bias=False, norm_placement="sandwich", loop_input_norm=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def gated(layout: str = "2R3", **halting) -> LoopLM:
    """A tiny Ouro-shaped loop with the exit gate; the gate's bias at 0 and weights large
    enough that positions exit at different steps."""
    model = LoopLM(tiny_config("base", layout=layout, **OURO_AXES, halting={"kind": "exit_gate", **halting}))
    with torch.no_grad():
        model.halting.gate.weight.mul_(60.0)
    return model


def per_step(model: LoopLM, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every step's logits head(norm(h_t)) and gate λ_t, from the loop states the model
    reports (h_t, t = 1..T), computed here independently of the halting rule."""
    states = model(x, output_states=True).states[1:]
    normed = [model.norm(h) for h in states]
    return [model.head(n) for n in normed], [torch.sigmoid(model.halting.gate(n).squeeze(-1)) for n in normed]


def test_exit_at_step_reads_out_that_step_whatever_the_gate_says():
    x = random_ids(2, 11)
    for k in range(3):
        model = gated(threshold=0.3, exit_at_step=k).eval()
        with torch.no_grad():
            out = model(x)
            logits, _ = per_step(model, x)
        torch.testing.assert_close(out.logits, logits[k], atol=1e-5, rtol=0)
        assert torch.equal(out.record["exit_step"][0], torch.full((2, 11), k))
    # the threshold rule alone exits at several steps here: the fixed step did override it
    with torch.no_grad():
        assert gated(threshold=0.3)(x).record["exit_step"][0].unique().numel() > 1


def test_exit_at_step_beyond_a_shorter_test_time_loop_falls_back_to_the_threshold():
    """Ouro ignores an exit step the forward does not reach (modeling_ouro.py)."""
    x = random_ids(2, 9)
    fixed, plain = gated(threshold=0.4, exit_at_step=2).eval(), gated(threshold=0.4).eval()
    plain.load_state_dict(fixed.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fixed(x, iterations=2).logits, plain(x, iterations=2).logits, atol=0, rtol=0)
        assert not torch.equal(fixed(x).logits, plain(x).logits)


def test_exit_at_step_keeps_cache_equivalence():
    model = gated(threshold=0.5, exit_at_step=1, objective="expected").eval()
    assert_decodes_like_full_forward(model, random_ids(2, 10), [prefill_then_tokens(3, 10), [4, 7, 10]], atol=2e-5)


@pytest.mark.parametrize("beta", [0.1, 0.0, 0.7])
def test_expected_objective_is_ouros_stage_one_loss(beta):
    """L = mean over positions with a target of Σ_t p(t) L^(t) − β H(p), p(t) = λ_t S_{t-1},
    the last step taking S_{T-2}; the readout's loss is reported, not trained."""
    model = gated(threshold=0.5, objective="expected", entropy_weight=beta)
    x, y = random_ids(2, 12), random_ids(2, 12, seed=1)
    y[0, :3] = -100  # ignored targets take no part in either term
    out = model(x, y)
    logits, lam = per_step(model, x)
    survive, p = torch.ones_like(lam[0]), []
    for t, l_t in enumerate(lam):
        p.append(survive if t == len(lam) - 1 else l_t * survive)
        survive = survive * (1 - l_t)
    p = torch.stack(p)  # [T_steps, B, T]
    torch.testing.assert_close(p.sum(0), torch.ones_like(p[0]))
    ce = torch.stack([F.cross_entropy(lg.transpose(1, 2), y, ignore_index=-100, reduction="none") for lg in logits])
    mask = y != -100
    expected = ((p * ce).sum(0) * mask).sum() / mask.sum()
    entropy = (-(p * p.log()).sum(0) * mask).sum() / mask.sum()
    torch.testing.assert_close(out.aux_losses["exit_expected_lm"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.aux_losses["exit_entropy"], -beta * entropy, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.loss, expected - beta * entropy, atol=1e-5, rtol=1e-5)
    readout = F.cross_entropy(out.logits.transpose(1, 2), y, ignore_index=-100)
    torch.testing.assert_close(out.lm_loss, readout)  # what evaluation reports: the selected readout


def test_expected_objective_trains_the_gate_and_every_step_readout_does_not():
    x, y = random_ids(2, 10), random_ids(2, 10, seed=1)
    expected = gated(threshold=0.5, objective="expected")
    expected(x, y).loss.backward()
    assert expected.halting.gate.weight.grad.abs().sum() > 0
    readout = gated(threshold=0.5)
    out = readout(x, y)
    assert out.loss is out.lm_loss and not out.aux_losses
    out.loss.backward()
    assert readout.halting.gate.weight.grad is None  # the selection is not differentiable


def test_expected_objective_lowers_its_loss_in_a_few_steps():
    model = gated(layout="1R3", objective="expected")
    x, y = random_ids(4, 12), random_ids(4, 12, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(x, y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize("fields, field", [
    (dict(layout="1R3+1", halting={"kind": "exit_gate", "objective": "expected"}), "model.layout"),
    (dict(layout="1R3", halting={"kind": "exit_gate", "exit_at_step": 3}), "model.halting.exit_at_step"),
    (dict(layout="1R3", halting={"kind": "exit_gate", "exit_at_step": -1}), "model.halting.exit_at_step"),
    (dict(layout="1R3", halting={"kind": "exit_gate", "objective": "weighted"}), "model.halting.objective"),
    (dict(layout="1R3", halting={"kind": "exit_gate", "entropy_weight": -0.1}), "model.halting.entropy_weight"),
    (dict(layout="1R3", halting={"kind": "act", "objective": "expected"}), "model.halting.objective"),
])
def test_bad_exit_gate_configs_name_the_field(fields, field):
    with pytest.raises(ConfigError) as err:
        tiny_config("base", **fields)
    assert err.value.field == field


def test_a_coda_with_the_readout_objective_is_allowed():
    model = LoopLM(tiny_config("base", layout="1R2+1", halting={"kind": "exit_gate", "exit_at_step": 0}))
    assert model(random_ids(1, 5), random_ids(1, 5, seed=1)).loss.isfinite()
