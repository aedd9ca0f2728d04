"""Two-stream and nested macro steps follow App. B.1's equations; step embeddings and
learned positions; what the streams refuse."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopLM
from looplm.config_base import ConfigError
from looplm.streams import TwoStream
from tests.conftest import ladder_config, random_ids, tiny_config


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class RecordingCore:
    """f(x) = 2x + (i + 1): a stand-in block that logs its inputs and pass indices."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, i):
        self.calls.append((x.clone(), i, x.requires_grad))
        return 2 * x + (i + 1)


@pytest.mark.parametrize("outer, inner", [(1, 1), (1, 2), (2, 1), (2, 3)])
def test_macro_step_follows_the_nested_schedule(outer, inner):
    streams = TwoStream(1, outer, inner, init="zeros", no_grad_cycles=False)
    x = torch.full((1, 1, 1), 3.0)
    state = streams.start(None, x, x)
    core = RecordingCore()
    new = streams.step(None, state, core, 0)
    # by hand: for each cycle, L times Z ← f(X + Y + Z), then Y ← f(Y + Z)
    y, z, expected_inputs, i = 0.0, 0.0, [], 0
    for _ in range(outer):
        for _ in range(inner):
            expected_inputs.append(3.0 + y + z)
            z = 2 * (3.0 + y + z) + i + 1
            i += 1
        expected_inputs.append(y + z)
        y = 2 * (y + z) + i + 1
        i += 1
    assert [c[1] for c in core.calls] == list(range(outer * (inner + 1))) == list(range(streams.passes))
    assert [c[0].item() for c in core.calls] == expected_inputs
    assert new.h.item() == y and new.carrier["z"].item() == z and new.carrier["x"].item() == 3.0


def test_no_grad_cycles_run_all_but_the_last_cycle_without_gradient():
    streams = TwoStream(1, outer=3, inner=1, init="random", no_grad_cycles=True)
    x = torch.ones(1, 1, 1, requires_grad=True)
    core = RecordingCore()
    new = streams.step(None, streams.start(None, x, x), core, 0)
    assert [c[2] for c in core.calls] == [False, False, False, False, True, True]
    new.h.sum().backward()
    assert x.grad is not None  # the last cycle still reaches the input stream


def test_learned_initial_states_are_parameters_and_zeros_are_not():
    learned = LoopLM(ladder_config("dual_ut", 4))
    zeros = LoopLM(ladder_config("dual_ut", 4, streams={"kind": "two", "init": "zeros"}))
    assert {n for n, _ in learned.streams.named_parameters()} == {"y_init", "z_init"}
    assert list(zeros.streams.parameters()) == [] and not zeros.streams.y_init.any()


def test_random_initial_states_are_saved_buffers_that_no_step_changes():
    """TRM's Y⁰, Z⁰: drawn at initialisation, fixed in training, part of the state dict."""
    streams = {"kind": "two", "outer": 2, "inner": 1, "init": "random", "no_grad_cycles": True}
    model = LoopLM(ladder_config("ar_trm", 6, streams=streams))
    assert list(model.streams.parameters()) == [] and model.streams.y_init.abs().sum() > 0
    assert {"streams.y_init", "streams.z_init"} <= set(model.state_dict())
    before = model.streams.y_init.clone()
    x = random_ids(2, 9)
    model(x, targets=x).loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.grad is not None], lr=1.0).step()
    assert torch.equal(model.streams.y_init, before)
    torch.manual_seed(123)  # another draw, then the saved one loaded over it
    other = LoopLM(model.cfg)
    assert not torch.equal(other.streams.y_init, before)
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other.eval()(x).logits, model.eval()(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("outer, no_grad_cycles", [(1, False), (2, False), (1, True)])
def test_learned_initial_states_get_a_gradient_wherever_they_are_accepted(outer, no_grad_cycles):
    streams = {"kind": "two", "outer": outer, "inner": 1, "no_grad_cycles": no_grad_cycles}
    model = LoopLM(ladder_config("dual_ut", 4 * outer, streams=streams))
    x = random_ids(2, 9)
    model(x, targets=x).loss.backward()
    assert model.streams.y_init.grad.abs().sum() > 0 and model.streams.z_init.grad.abs().sum() > 0


def test_learned_initial_states_that_no_cycle_trains_are_refused():
    """With H > 1 no-grad cycles, the one cycle with gradient reads Y, Z from a no-grad one."""
    with pytest.raises(ConfigError, match=r"model\.streams\.init.*'learned'.*'random' or 'zeros'"):
        ladder_config("dual_ut", 8, streams={"kind": "two", "outer": 2, "inner": 1, "no_grad_cycles": True})


def test_latents_are_reinitialised_on_every_forward():
    """No state crosses calls (autoregressive-trm §3.2, Challenge 2): the same input gives
    the same logits whatever ran before."""
    model = LoopLM(ladder_config("ar_trm", 6)).eval()
    x = random_ids(2, 9)
    first = model(x).logits
    model(random_ids(2, 9, seed=5))
    torch.testing.assert_close(model(x).logits, first)


def test_step_embedding_is_added_before_every_core_pass():
    """H^(k+1) = f(H^(k) + e_k): hooks see the core input shifted by e_k."""
    model = LoopLM(ladder_config("tied_step", 3))
    seen = []
    model.core[0][0].register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    x = random_ids(1, 5)
    out = model(x, output_states=True)
    for k in range(3):
        torch.testing.assert_close(seen[k], out.states[k] + model.step_embedding.weight[k])


def test_step_embeddings_can_be_switched_off_to_extrapolate():
    model = LoopLM(ladder_config("tied_step", 4)).eval()
    x = random_ids(1, 6)
    with pytest.raises(ConfigError, match="step embeddings"):
        model(x, iterations=6)
    model.step_embedding.enabled = False
    off = model(x, iterations=6).logits
    plain = LoopLM(ladder_config("tied", 4)).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("step_embedding")})
    torch.testing.assert_close(off, plain(x, iterations=6).logits)


def test_learned_positions_replace_rotary():
    model = LoopLM(tiny_config("base", position="learned"))
    assert model.cfg.rotary_dim == 0 and model.pos_embed.weight.shape == (128, 32)
    x = random_ids(1, 6)
    base = model(x).logits
    with torch.no_grad():
        model.pos_embed.weight[3] += torch.randn(32)  # (a constant shift would vanish in LayerNorm)
    changed = model(x).logits
    torch.testing.assert_close(changed[:, :3], base[:, :3])
    assert (changed[:, 3:] - base[:, 3:]).abs().max() > 1e-4


def test_macro_steps_number_their_passes_in_the_cache():
    from looplm import LoopCache

    model = LoopLM(ladder_config("dual_nested_ut", 6)).eval()  # 2 macro steps × 3 passes
    cache = LoopCache()
    model(random_ids(1, 4), cache=cache)
    assert sorted({slot for (block, slot) in cache.states}) == list(range(6))


@pytest.mark.parametrize(
    "topology, fields, field",
    [
        ("mesh", dict(layout="1R2", streams={"kind": "two"}), "model.topology.kind"),
        ("base", dict(layout="1R2", share_core=False, streams={"kind": "two"}), "model.share_core"),
        ("base", dict(layout="1x{1/2,1}", streams={"kind": "two"}), "model.layout"),
        ("base", dict(layout="3", streams={"kind": "two"}), "model.streams.kind"),
        ("base", dict(layout="3", step_embeddings=True), "model.step_embeddings"),
        ("base", dict(layout="1R2", streams={"kind": "single", "inner": 2}), "model.streams.inner"),
        ("base", dict(layout="1R2", streams={"kind": "two", "outer": 0}), "model.streams.outer"),
    ],
)
def test_bad_stream_configs_name_the_field(topology, fields, field):
    with pytest.raises(ConfigError) as err:
        tiny_config(topology, **fields)
    assert err.value.field == field
