"""model.depth: Huginn's recurrence count per training step and truncated backpropagation
(arXiv 2502.05171 §3.3, Eq. 2): the draw, the gradient window, the memory it keeps, the
FLOPs it is charged, the trainer's seam and the refusals."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from looplm import LoopLM
from looplm.accounting import count_flops
from looplm.config_base import ConfigError
from looplm.depth import DepthConfig, LogNormalPoissonDepthConfig
from looplm.train.callbacks import lm_loss, default_objective
from tests.conftest import random_ids, tiny_config

HUGINN = dict(layout="1+2R4+1", norm="rmsnorm", mlp="swiglu", bias=False)


def huginn(k=None, kind="fixed", topology="concat_adapter", **overrides):
    return tiny_config(topology, **{**HUGINN, "depth": {"kind": kind, "backprop_window": k}, **overrides})


# ------------------------------------------------------------------ the draw (Eq. 2)
def test_count_is_a_pure_function_of_seed_and_step():
    depth = LogNormalPoissonDepthConfig()
    assert [depth.count(32, 0, s) for s in range(50)] == [depth.count(32, 0, s) for s in range(50)]
    assert [depth.count(32, 0, s) for s in range(50)] != [depth.count(32, 1, s) for s in range(50)]


def test_count_follows_the_lognormal_poisson_of_equation_2():
    depth, mean, n = LogNormalPoissonDepthConfig(sigma=0.5), 32, 4000
    r = np.array([depth.count(mean, 7, s) for s in range(n)])
    assert r.min() >= 1
    # E[r] = E[e^τ] + 1 = r̄ + 1; Var[r] = E[λ] + Var[λ] = r̄ + r̄²(e^{σ²} − 1)
    var = mean + mean**2 * (math.exp(0.25) - 1)
    assert abs(r.mean() - (mean + 1)) < 4 * math.sqrt(var / n)
    assert abs(r.var() / var - 1) < 0.15
    assert (r > 2 * mean).mean() > 0.02  # heavy right tail: P(r > 2r̄) ≈ 6 % (a plain Poisson(32): < 1e-6)


def test_fixed_depth_runs_the_layout_count():
    assert DepthConfig.from_dict({"backprop_window": 3}).count(5, 0, 9) == 5


# ------------------------------------------------------------------ truncated backprop
def _grads(model, ids, iterations):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same s_0 draw in every model
    model(ids, ids, iterations=iterations).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("r,k", [(6, 2), (5, 1), (3, 3), (2, 4)])
def test_gradients_flow_through_exactly_the_last_k_iterations(r, k):
    """The window's gradients equal those of a full-backprop model whose state is detached
    after iteration r − k (the first iterations then contribute nothing); the core runs its
    backward k times, not r."""
    torch.manual_seed(0)
    windowed = LoopLM(huginn(k)).train()
    reference = LoopLM(huginn(None)).train()
    reference.load_state_dict(windowed.state_dict())
    cut = max(r - k, 0)
    step = type(reference.topology).step

    def detached_step(self, state, update, t):
        new = step(self, state, update, t)
        return dataclasses.replace(new, h=new.h.detach()) if t == cut - 1 else new

    reference.topology.step = detached_step.__get__(reference.topology)
    ids = random_ids(2, 9)
    backward_calls = []
    hooks = [b.register_full_backward_hook(lambda *a: backward_calls.append(1)) for b in windowed.core[0]]
    got = _grads(windowed, ids, r)
    for h in hooks:
        h.remove()
    want = _grads(reference, ids, r)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert len(backward_calls) == min(k, r) * len(windowed.core[0])
    full_model = LoopLM(huginn(None)).train()
    full_model.load_state_dict(windowed.state_dict())
    full = _grads(full_model, ids, r)
    if cut:  # the window changes the gradients (the test above is not met by full backprop)
        assert any(not torch.allclose(full[n], got[n]) for n in got if n in full)


def _saved_bytes(model, ids, r):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, ids, iterations=r).loss
    loss.backward()
    return total[0]


def test_saved_activations_follow_the_window_not_the_count():
    torch.manual_seed(0)
    windowed, full = LoopLM(huginn(2)).train(), LoopLM(huginn(None)).train()
    ids = random_ids(2, 16)
    saved = {r: _saved_bytes(windowed, ids, r) for r in (2, 4, 8, 16)}
    assert len(set(saved.values())) == 1, saved  # r − k no-grad iterations save nothing
    grows = [_saved_bytes(full, ids, r) for r in (2, 4)]
    assert grows[1] > 1.5 * grows[0]


def test_inference_ignores_the_window():
    model = LoopLM(huginn(1)).eval()
    ids = random_ids(1, 6)
    with torch.no_grad():
        a = model(ids, iterations=6).logits
    b = model(ids, iterations=6).logits  # grad enabled, eval: the window still only changes the backward
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------ FLOPs
@pytest.mark.parametrize("r", [1, 3, 12])
def test_training_flops_count_the_drawn_count_and_no_grad_iterations_once(r):
    k, seq = 2, 16
    cfg = huginn(k, kind="lognormal_poisson")
    report = count_flops(cfg, seq, iterations=r)
    one = count_flops(cfg, seq, iterations=1).forward
    per_iteration = count_flops(cfg, seq, iterations=2).forward - one
    assert report.forward == pytest.approx(one + (r - 1) * per_iteration)
    assert report.no_grad == pytest.approx(max(r - k, 0) * per_iteration)
    assert report.training == pytest.approx(3 * report.forward - 2 * report.no_grad)
    d = cfg.d_model
    assert report.components["topology"] == pytest.approx(r * 2 * seq * 2 * d * d)  # A: 2d -> d per iteration


# ------------------------------------------------------------------ the trainer's seam
def test_the_default_objective_runs_the_count_drawn_for_the_step():
    cfg = huginn(2, kind="lognormal_poisson")
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, inputs, targets, iterations=None):
            seen.append(iterations)
            return type("Out", (), {"loss": torch.zeros(()), "aux_losses": {}})()

    loss = default_objective(cfg, seed=3)
    for step in range(5):
        loss(Recorder(), None, None, step)
    assert seen == [cfg.depth.count(cfg.iterations, 3, s) for s in range(5)]
    assert default_objective(huginn(2), seed=3) is lm_loss  # a fixed count: the plain objective


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("field,overrides", [
    ("model.topology.kind", dict(topology="mesh")),
    ("model.topology.kind", dict(topology="gated_residual")),
    ("model.share_core", dict(share_core=False)),
    ("model.step_embeddings", dict(step_embeddings=True)),
    ("model.halting.kind", dict(halting={"kind": "act"})),
    ("model.lora.rank", dict(lora={"rank": 2, "targets": ["mlp"]})),
    ("model.moe.per_iteration", dict(moe={"experts": 3, "top_k": 1, "per_iteration": True})),
])
def test_a_drawn_count_needs_a_loop_that_runs_any_count(field, overrides):
    with pytest.raises(ConfigError, match=field):
        huginn(2, kind="lognormal_poisson", **overrides)


def test_depth_settings_are_checked():
    with pytest.raises(ConfigError, match="model.depth.backprop_window"):
        huginn(0)
    with pytest.raises(ConfigError, match="model.depth.sigma"):
        DepthConfig.from_dict({"kind": "lognormal_poisson", "sigma": 0})
    with pytest.raises(ConfigError, match="model.depth"):
        tiny_config("base", layout="3", depth={"kind": "fixed", "backprop_window": 2})
    with pytest.raises(ConfigError, match="sigma"):
        DepthConfig.from_dict({"kind": "fixed", "sigma": 0.5})


def test_an_iteration_before_the_window_dispatches_only_its_forward():
    """Each iteration outside the window adds exactly the operators of its forward (no
    autograd bookkeeping, no backward): cost follows the FLOPs the counter charges (once)."""
    from looplm.accounting.dispatch import count_dispatch

    torch.manual_seed(0)
    model = LoopLM(huginn(2)).train()
    ids = random_ids(2, 8)

    def training(r):
        def run():
            model(ids, ids, iterations=r).loss.backward()
        return count_dispatch(run)[0]

    def forward(r):
        def run():
            with torch.no_grad():
                model(ids, ids, iterations=r)
        return count_dispatch(run)[0]

    training(3), forward(3)  # warm: one-time setup (rotary tables) out of the counts
    extra_train = training(6).ops - training(5).ops
    extra_forward = forward(6).ops - forward(5).ops
    assert extra_train == extra_forward, (training(6).by_op, training(5).by_op)
    assert training(6).syncs == training(2).syncs


# A truncated backward needs a topology that re-reads the loop input (found by fuzzing the
# FLOP counter: the prelude and the embeddings got no gradient while their backward was counted)
@pytest.mark.parametrize("topology", ["base", "residual", "gated_residual", "mesh", "anchor_embedding"])
def test_truncated_backward_needs_a_topology_that_rereads_the_loop_input(topology):
    with pytest.raises(ConfigError, match="model.topology.kind"):
        tiny_config(topology, layout="1+1R3+1", depth={"kind": "fixed", "backprop_window": 1})


@pytest.mark.parametrize("topology,layout", [("anchor", "1+1R3+1"), ("additive", "1+1R3+1"),
                                             ("static_combination", "1+1R3+1"), ("dynamic_combination", "1+1R3+1"),
                                             ("concat_adapter", "1+1R3+1"), ("anchor_embedding", "2R3")])
def test_accepted_truncated_backward_reaches_the_prelude_and_the_embeddings(topology, layout):
    cfg = tiny_config(topology, layout=layout, depth={"kind": "fixed", "backprop_window": 1})
    torch.manual_seed(0)
    model = LoopLM(cfg).train()
    x = random_ids(2, 8)
    model(x, targets=random_ids(2, 8, seed=1)).loss.backward()
    assert model.embed.weight.grad is not None and model.embed.weight.grad.abs().sum() > 0
    for name, p in model.prelude.named_parameters():
        assert p.grad is not None, name


def test_a_window_covering_the_loop_truncates_nothing_and_stays_allowed():
    tiny_config("base", layout="1+1R2+1", depth={"kind": "fixed", "backprop_window": 2})
