"""Halting rules: ACT's weights, remainder and ponder cost; Q-halt's rule, readout and
training signal; full compute runs exactly C block passes; adaptive halting stops early."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopCache, LoopLM
from looplm.config_base import ConfigError
from looplm.halting import ACTHalting, QHalting
from tests.conftest import ladder_config, random_ids, tiny_config
from tests.invariants import assert_decodes_like_full_forward, prefill_then_tokens


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def constant_act(p: float, epsilon: float = 0.01, ponder_cost: float = 0.5, full_compute: bool = False) -> ACTHalting:
    """An ACT rule whose halting probability is p everywhere."""
    act = ACTHalting(4, epsilon, ponder_cost, full_compute)
    torch.nn.init.zeros_(act.unit.weight)
    torch.nn.init.constant_(act.unit.bias, torch.logit(torch.tensor(p)).item())
    return act


def run_rule(rule, states: list[torch.Tensor], targets=None, read_logits=None):
    valid = torch.ones(states[0].shape[:2], dtype=torch.bool)
    halt = rule.begin(states[0], valid)
    for t, y in enumerate(states):
        rule.observe(halt, y, t, t == len(states) - 1, read_logits, targets)
    return halt, rule.finish(halt)


def test_act_hand_computed_case():
    """p = 0.4, ε = 0.01, four steps: Σp reaches 1.2 ≥ 0.99 at step 3, so N = 3,
    R = 1 − 0.8 = 0.2, weights (0.4, 0.4, 0.2, 0), ρ = N + R = 3.2."""
    states = [torch.full((1, 2, 4), float(k + 1)) for k in range(4)]
    halt, readout = run_rule(constant_act(0.4), states)
    weights = torch.stack(halt.record["act_weights"])[:, 0, 0]
    torch.testing.assert_close(weights, torch.tensor([0.4, 0.4, 0.2, 0.0]))
    torch.testing.assert_close(readout, torch.full((1, 2, 4), 0.4 * 1 + 0.4 * 2 + 0.2 * 3))
    torch.testing.assert_close(halt.losses["ponder"], torch.tensor(0.5 * 3.2))
    assert halt.steps.tolist() == [[3, 3]]  # halted positions stop updating after step 3


def test_act_halts_after_one_step_when_p_exceeds_threshold():
    halt, readout = run_rule(constant_act(0.995), [torch.ones(1, 1, 4), 2 * torch.ones(1, 1, 4)])
    assert halt.steps.tolist() == [[1]]
    torch.testing.assert_close(readout, torch.ones(1, 1, 4))  # w_1 = R = 1
    torch.testing.assert_close(halt.losses["ponder"], torch.tensor(0.5 * (1 + 1.0)))


def test_act_caps_at_the_last_step_with_the_remainder():
    halt, _ = run_rule(constant_act(0.1), [torch.ones(1, 1, 4)] * 3)
    weights = torch.stack(halt.record["act_weights"])[:, 0, 0]
    torch.testing.assert_close(weights, torch.tensor([0.1, 0.1, 0.8]))


def test_act_full_compute_keeps_weights_but_never_freezes_or_charges():
    halt, _ = run_rule(constant_act(0.4, full_compute=True), [torch.ones(1, 2, 4)] * 4)
    assert halt.steps.tolist() == [[4, 4]] and bool(halt.running.all())
    assert "ponder" not in halt.losses


@pytest.mark.parametrize("full_compute", [False, True])
def test_act_weights_sum_to_one_per_position_in_a_model(full_compute):
    cfg = ladder_config("dual_ut", 8, halting={"kind": "act", "full_compute": full_compute})
    model = LoopLM(cfg)
    torch.nn.init.normal_(model.halting.unit.weight, std=1.0)  # spread the halting steps
    out = model(random_ids(3, 11))
    total = torch.stack(out.record["act_weights"]).sum(dim=0)
    torch.testing.assert_close(total, torch.ones_like(total))


def test_ponder_cost_joins_the_loss():
    cfg = tiny_config("base", layout="1R4", halting={"kind": "act", "ponder_cost": 0.3})
    x = random_ids(2, 9)
    out = LoopLM(cfg)(x, targets=x)
    assert set(out.aux_losses) == {"ponder"}
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_losses["ponder"])


def count_block_passes(model: LoopLM) -> list[int]:
    calls = [0]
    for block in model.blocks():
        block.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("rung", ["dense", "tied", "tied_step", "ut_act", "dual_ut", "dual_nested_ut", "ar_trm"])
def test_full_compute_runs_exactly_the_budget(rung):
    model = LoopLM(ladder_config(rung, 12))
    if model.halting is not None and hasattr(model.halting, "unit"):
        torch.nn.init.constant_(model.halting.unit.bias, 10.0)  # would halt at once if it could
    calls = count_block_passes(model)
    out = model(random_ids(2, 7))
    assert calls[0] == 12 == model.cfg.block_passes
    if out.block_passes is not None:
        assert bool((out.block_passes == 12).all())


def test_adaptive_act_stops_once_every_position_halts_and_reports_realised_passes():
    cfg = ladder_config("ut_act", 6, halting={"kind": "act", "full_compute": False})
    model = LoopLM(cfg).eval()
    torch.nn.init.constant_(model.halting.unit.bias, 10.0)  # p ≈ 1: every position halts at step 1
    calls = count_block_passes(model)
    x = random_ids(2, 7)
    out = model(x)
    assert calls[0] == 1
    assert bool((out.block_passes == 1).all())
    # decoding token by token also stops after one step per token, and saves the compute
    calls[0], cache, pieces, spent = 0, LoopCache(), [], 0
    for end in prefill_then_tokens(3, 7):
        piece = model(x[:, cache.get_seq_length():end], cache=cache)
        pieces.append(piece.logits)
        spent += int(piece.block_passes.sum() + piece.catch_up_passes)
    assert calls[0] == 5  # one block pass per call: no position ever needs a later step
    assert spent / x.numel() == 1.0
    torch.testing.assert_close(torch.cat(pieces, dim=1), out.logits, atol=1e-5, rtol=1e-5)


def test_catch_up_fills_later_steps_for_positions_that_stopped_early():
    """Tokens 0-3 halt at step 1; token 4 runs all six steps: before each of its later
    steps, the cached positions get their entries from their frozen states."""
    cfg = ladder_config("ut_act", 6, halting={"kind": "act", "full_compute": False})
    model = LoopLM(cfg).eval()
    torch.nn.init.zeros_(model.halting.unit.weight)
    x = random_ids(1, 5)
    full_bias = torch.tensor(10.0)

    def halting_bias_by_position(module, args, output):  # p ≈ 1 for positions < 4, p ≈ 0 after
        seq = output.shape[1]
        first = model._halting_offset
        bias = torch.where(torch.arange(first, first + seq) < 4, full_bias, -full_bias)
        return output + bias.view(1, seq, 1)

    model.halting.unit.register_forward_hook(halting_bias_by_position)
    model._halting_offset = 0
    full = model(x)
    assert full.halt_steps.tolist() == [[1, 1, 1, 1, 6]]
    cache = LoopCache()
    first = model(x[:, :4], cache=cache).logits
    assert cache.steps_done.tolist() == [1, 1, 1, 1]
    model._halting_offset = 4
    last = model(x[:, 4:], cache=cache).logits
    assert cache.steps_done.tolist() == [6] * 5
    torch.testing.assert_close(torch.cat([first, last], dim=1), full.logits, atol=1e-5, rtol=1e-5)
    assert cache.get("core.0", 5).end == 5  # every position has the last step's keys
    cache.crop(3)
    assert cache.steps_done.tolist() == [6] * 3 and cache.frozen.h.shape[1] == 3


def test_qhalt_halts_where_sigma_q_exceeds_one_half():
    """Position 0 has q > 0 from step 1, position 1 from step 2, position 2 never."""
    rule = QHalting(4, loss_weight=1.0, full_compute=False)
    torch.nn.init.zeros_(rule.head.bias)
    with torch.no_grad():
        rule.head.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    step1 = torch.tensor([[[1.0, 0, 0, 0], [-1.0, 0, 0, 0], [-1.0, 0, 0, 0]]])
    step2 = torch.tensor([[[9.0, 0, 0, 0], [2.0, 0, 0, 0], [-1.0, 0, 0, 0]]])
    step3 = torch.tensor([[[9.0, 0, 0, 0], [9.0, 0, 0, 0], [-2.0, 0, 0, 0]]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    halt = rule.begin(step1, valid)
    halted_after = []
    for t, y in enumerate([step1, step2, step3]):
        rule.observe(halt, y, t, t == 2, None, None)
        halted_after.append(halt.halted[0].tolist())
    assert halted_after == [[True, False, False], [True, True, False], [True, True, True]]
    assert halt.steps.tolist() == [[1, 2, 3]]


def test_qhalt_model_reads_out_the_solution_where_it_halts():
    """With σ(q) > 0.5 at once, an adaptive AR-TRM reads out Y after the first macro step:
    the same logits as the model run for one macro step."""
    cfg = ladder_config("ar_trm", 9, halting={"kind": "qhalt", "full_compute": False})
    model = LoopLM(cfg).eval()
    torch.nn.init.constant_(model.halting.head.bias, 5.0)
    x = random_ids(2, 8)
    out = model(x)
    assert bool((out.halt_steps == 1).all())
    torch.testing.assert_close(out.logits, model(x, iterations=1).logits)


def test_qhalt_target_is_correctness_and_the_head_learns():
    cfg = ladder_config("ar_trm", 6)
    model = LoopLM(cfg)
    x = random_ids(2, 9, vocab=cfg.vocab_size)
    targets = x.roll(-1, dims=1)
    targets[:, :3] = -100
    out = model(x, targets=targets)
    assert set(out.aux_losses) == {"q_halt"}
    # by hand: BCE(q, 1[argmax logits(Y_t) = target]) over steps and positions with targets
    captured = []
    model.halting.head.register_forward_hook(lambda m, i, o: captured.append((i[0].detach(), o.detach())))
    model(x, targets=targets)
    losses = []
    for y, q in captured:
        correct = (model.head(model.norm(y)).argmax(-1) == targets).float()
        bce = torch.nn.functional.binary_cross_entropy_with_logits(q.squeeze(-1), correct, reduction="none")
        losses.append(bce[targets != -100])
    torch.testing.assert_close(out.aux_losses["q_halt"], torch.cat(losses).mean(), atol=1e-5, rtol=1e-5)
    out.loss.backward()
    assert model.halting.head.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("rung", ["ut_act", "ar_trm"])
def test_adaptive_halting_keeps_cache_equivalence_when_positions_halt_at_different_steps(rung):
    cfg = ladder_config(rung, 12, halting={"kind": "act" if rung == "ut_act" else "qhalt", "full_compute": False})
    model = LoopLM(cfg).eval()
    head = model.halting.unit if rung == "ut_act" else model.halting.head
    torch.nn.init.normal_(head.weight, std=2.0)
    torch.nn.init.zeros_(head.bias)
    x = random_ids(2, 12)
    if rung == "ar_trm":  # centre q at the first step so that about half the positions halt there
        first = []
        hook = head.register_forward_hook(lambda m, i, o: first.append(o.detach()))
        model(x)
        hook.remove()
        # between the two middle values (median() is one of them): no position at q = 0 exactly,
        # where decoding's rounding (it depends on shapes and thread count) could flip its halt
        torch.nn.init.constant_(head.bias, -first[0].quantile(0.5).item())
    steps = model(x).halt_steps
    assert steps.unique().numel() > 1, "the check needs positions that halt at different steps"
    assert_decodes_like_full_forward(model, x, [prefill_then_tokens(4, 12), [3, 7, 12]], atol=2e-5)


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(layout="3", halting={"kind": "act"}), "model.halting.kind"),
        (dict(layout="1R2", topology={"kind": "mesh"}, halting={"kind": "act"}), "model.topology.kind"),
        (dict(layout="1R2+1", halting={"kind": "qhalt"}), "model.layout"),
        (dict(layout="1R2", halting={"kind": "none", "full_compute": True}), "model.halting.full_compute"),
        (dict(layout="1R2", halting={"kind": "act", "epsilon": 1.0}), "model.halting.epsilon"),
    ],
)
def test_bad_halting_configs_name_the_field(fields, field):
    with pytest.raises(ConfigError) as err:
        tiny_config(**{"topology": "base", **fields}) if "topology" not in fields else tiny_config(
            fields.pop("topology")["kind"], **fields)
    assert err.value.field == field


def test_generation_reports_realised_block_passes():
    model = LoopLM(ladder_config("ut_act", 6, halting={"kind": "act", "full_compute": False})).eval()
    full = LoopLM(ladder_config("ut_act", 6)).eval()
    torch.nn.init.constant_(model.halting.unit.bias, 10.0)
    prompt = random_ids(2, 5).tolist()
    assert model.generate(prompt, max_new_tokens=4).block_passes_per_token == 1.0
    assert full.generate(prompt, max_new_tokens=4).block_passes_per_token == 6.0


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.invariants import assert_strictly_causal  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(
    streams=st.sampled_from([{"kind": "single"}, {"kind": "two"}, {"kind": "two", "outer": 2, "inner": 1},
                             {"kind": "two", "inner": 2, "init": "zeros", "no_grad_cycles": True}]),
    halting=st.sampled_from(["none", "act", "qhalt"]),
    full_compute=st.booleans(),
    step_embeddings=st.booleans(),
    position=st.sampled_from(["rotary", "learned"]),
    steps=st.integers(1, 3),
    topology=st.sampled_from(["base", "anchor", "gated_residual"]),
    head_scale=st.floats(0.0, 3.0),
    seed=st.integers(0, 3),
)
def test_loop_axes_keep_causality_and_cache_equivalence(streams, halting, full_compute, step_embeddings, position,
                                                       steps, topology, head_scale, seed):
    """Every combination of streams × halting × step signal × positions: strictly causal,
    and decoding (prefill, single tokens, chunks) equals the full forward, also when the
    halting head makes positions stop at different steps."""
    if streams["kind"] == "two":
        topology = "base"
    fields = dict(layout=f"1R{steps}", streams=streams, step_embeddings=step_embeddings, position=position,
                  halting={"kind": halting, "full_compute": full_compute and halting != "none"})
    torch.manual_seed(seed)
    model = LoopLM(tiny_config(topology, **fields)).eval()
    head = getattr(model.halting, "unit", None) or getattr(model.halting, "head", None)
    if head is not None:
        torch.nn.init.normal_(head.weight, std=head_scale)
        torch.nn.init.zeros_(head.bias)
    x = random_ids(2, 10, seed=seed)
    assert_strictly_causal(model, x, (0, 5, 9), shift=5)
    assert_decodes_like_full_forward(model, x, [prefill_then_tokens(3, 10), [4, 7, 10]], atol=3e-5)


def test_halting_init_bias_is_configurable_with_source_defaults():
    assert LoopLM(ladder_config("ut_act", 4)).halting.unit.bias.item() == 1.0
    assert LoopLM(ladder_config("ar_trm", 6)).halting.head.bias.item() == -5.0
    spread = LoopLM(ladder_config("ut_act", 4, halting={"kind": "act", "init_bias": -3.0, "full_compute": True}))
    assert spread.halting.unit.bias.item() == -3.0
    weights = torch.stack(spread(random_ids(1, 5)).record["act_weights"])[:, 0]
    assert bool((weights[-1] > 0.5).all())  # p ≈ 0.05: most of the readout on the last step
    with pytest.raises(ConfigError):
        tiny_config("base", layout="1R2", halting={"kind": "none", "init_bias": 0.0})
