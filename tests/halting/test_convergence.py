"""Zero-shot adaptive exit (Huginn's criterion): the criteria against hand computations on
fixed logits; decode == forward with catch-up; a loop whose iterations converge exits
early, one that does not runs the full loop and equals the model without the exit; set
on a trained model at load time; refusals."""

from __future__ import annotations

import math

import pytest
import torch

from looplm import LoopCache, LoopLM
from looplm.config_base import ConfigError
from looplm.eval.adaptive_exit import ExitSpec, with_zero_shot_exit
from looplm.halting.base import Readout
from looplm.halting.convergence import ConvergenceExit, entropy, kl_to_previous
from tests.conftest import random_ids, tiny_config


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_kl_and_entropy_against_hand_computations():
    p_prev = torch.tensor([0.5, 0.5])
    p = torch.tensor([0.9, 0.1])
    expected_kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # KL(p_{t-1} ‖ p_t)
    assert kl_to_previous(p.log(), p_prev.log()).item() == pytest.approx(expected_kl, rel=1e-6)
    assert kl_to_previous(p.log(), p.log()).item() == 0.0
    assert entropy(torch.tensor([0.5, 0.25, 0.25]).log()).item() == pytest.approx(1.5 * math.log(2), rel=1e-6)


def observe_logits(rule: ConvergenceExit, steps: list[torch.Tensor]):
    """Run the rule over fixed per-step logits [B, T, V] (the 'state' is the logits; norm and
    head are identities), as the loop would."""
    readout = Readout(norm=lambda y: y, head=lambda y: y)
    state = rule.begin(steps[0], torch.ones(steps[0].shape[:2], dtype=torch.bool))
    for t, y in enumerate(steps):
        rule.observe(state, y, t, t == len(steps) - 1, readout, None)
    return state


def test_kl_rule_exits_where_successive_distributions_agree_on_fixed_logits():
    # position 0: the same distribution from step 0 on -> exits after step 1 (KL = 0);
    # position 1: moves by KL([.5,.5] ‖ [.9,.1]) = 0.51 then by a little, 1e-3 ; position 2 never settles
    a, b = torch.tensor([0.0, 0.0]), torch.tensor([math.log(9.0), 0.0])
    steps = [torch.stack([a, a, a]), torch.stack([a, b, b]), torch.stack([a, b + torch.tensor([0.1, 0.0]), a]),
             torch.stack([a, b, b])]
    steps = [s.unsqueeze(0) for s in steps]  # [1, 3, 2]
    values = [kl_to_previous(torch.log_softmax(steps[t], -1), torch.log_softmax(steps[t - 1], -1))
              for t in range(1, 4)]
    threshold = 0.01
    assert values[1][0, 1] < threshold < values[0][0, 1]  # position 1 settles at step 2 (hand check above)
    state = observe_logits(ConvergenceExit("kl", threshold), steps)
    assert state.steps.tolist() == [[2, 3, 4]]
    # the readout holds each position's state at its exit step (the loop freezes it there;
    # here the fixed logits move on, so the last y is what observe saw last)
    assert state.halted.all()


def test_entropy_rule_may_exit_at_the_first_step_and_compares_in_nats():
    confident = torch.tensor([8.0, 0.0, 0.0])
    flat = torch.zeros(3)
    h_confident = entropy(torch.log_softmax(confident, -1)).item()
    assert h_confident < 0.01 < math.log(3)
    steps = [torch.stack([confident, flat]).unsqueeze(0), torch.stack([confident, flat]).unsqueeze(0)]
    state = observe_logits(ConvergenceExit("entropy", 0.01), steps)
    assert state.steps.tolist() == [[1, 2]]


def identity_core(model: LoopLM) -> LoopLM:
    """Zero the core blocks' output projections: each block is the identity, so with the
    base topology every loop state equals the first and the distributions agree at once."""
    with torch.no_grad():
        for name, param in model.core.named_parameters():
            if ".o_proj." in name or ".down." in name:
                param.zero_()
    return model


def test_a_loop_that_converges_exits_after_two_steps():
    cfg = tiny_config("base", layout="1+1R4+1", halting={"kind": "convergence", "criterion": "kl", "threshold": 1e-6})
    model = identity_core(LoopLM(cfg)).eval()
    out = model(random_ids(2, 9))
    assert torch.equal(out.halt_steps, torch.full((2, 9), 2))  # KL(p_0 ‖ p_1) = 0 < threshold
    assert torch.equal(out.block_passes, torch.full((2, 9), 1 + 2 + 1))
    assert len(out.record["exit_value"]) == 2  # the loop stopped once every position had exited


def test_a_loop_that_does_not_converge_runs_every_step_and_equals_the_full_loop():
    fixed = LoopLM(tiny_config("anchor", layout="1+1R4+1", init_std=0.3)).eval()
    exiting = with_zero_shot_exit(fixed, ExitSpec("kl", 1e-12))
    x = random_ids(2, 9)
    out, full = exiting(x), fixed(x)
    assert torch.equal(out.halt_steps, torch.full((2, 9), 4))
    torch.testing.assert_close(out.logits, full.logits, atol=0, rtol=0)
    assert fixed.halting.__class__ is not exiting.halting.__class__  # the original keeps its rule


def test_exit_set_at_load_time_saves_passes_and_decodes_like_the_full_forward():
    """Batch 1, one token at a time: a token that needs a step an earlier one skipped
    catches the cache up first (LoopLM._catch_up), so decoding equals one full forward."""
    fixed = LoopLM(tiny_config("anchor", layout="1+1R4+1", init_std=0.3)).eval()
    exiting = with_zero_shot_exit(fixed, ExitSpec("kl", 0.01))
    for name, param in fixed.named_parameters():
        assert param is exiting.get_parameter(name)  # shared, not copied
    x = random_ids(1, 14, seed=3)
    with torch.no_grad():
        full = exiting(x)
        steps = full.halt_steps.flatten()
        assert steps.min() < 4 and steps.max() == 4  # some positions exit early, some run the loop
        cache, pieces, catch_up = LoopCache(), [], 0
        for i in range(x.shape[1]):
            out = exiting(x[:, i:i + 1], cache=cache)
            pieces.append(out.logits)
            catch_up += int(out.catch_up_passes)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full.logits, atol=2e-5, rtol=1e-5)
    assert catch_up > 0, "not vacuous: some token needed a step that an earlier one had skipped"


def test_generate_reports_the_passes_the_exit_saved():
    fixed = LoopLM(tiny_config("anchor", layout="1+1R3+1", init_std=0.3)).eval()
    exiting = with_zero_shot_exit(fixed, ExitSpec("kl", 0.03))
    prompt = random_ids(1, 5)
    full = fixed.generate(prompt, max_new_tokens=6, temperature=0.0)
    early = exiting.generate(prompt, max_new_tokens=6, temperature=0.0)
    assert full.block_passes_per_token == 1 + 3 + 1
    assert early.block_passes_per_token < full.block_passes_per_token


@pytest.mark.parametrize("fields,field", [
    (dict(criterion="cosine"), "model.halting.criterion"),
    (dict(threshold=0.0), "model.halting.threshold"),
    (dict(threshold=-1e-3), "model.halting.threshold"),
])
def test_bad_exit_settings_are_refused_naming_the_field(fields, field):
    with pytest.raises(ConfigError, match=field):
        tiny_config(halting={"kind": "convergence", **fields})


def test_exit_refused_where_a_position_cannot_freeze_or_the_rule_has_parameters():
    with pytest.raises(ConfigError, match="model.topology"):
        with_zero_shot_exit(LoopLM(tiny_config("mesh")), ExitSpec("kl", 1e-3))
    with pytest.raises(ConfigError, match="parameters the zero-shot exit would drop"):
        with_zero_shot_exit(LoopLM(tiny_config("base", halting={"kind": "act"})), ExitSpec("kl", 1e-3))
    with pytest.raises(ConfigError, match="no loop"):
        with_zero_shot_exit(LoopLM(tiny_config("base", layout="3")), ExitSpec("kl", 1e-3))
    with pytest.raises(ConfigError, match="CRITERION:THRESHOLD"):
        ExitSpec.parse("kl")
    with pytest.raises(ConfigError, match="model.halting.criterion"):
        ExitSpec.parse("cosine:0.1")
