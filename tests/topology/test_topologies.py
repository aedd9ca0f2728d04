"""Each topology implements its paper's equation (checked against a literal transcription)."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopLM
from looplm.config_base import ConfigError
from looplm.topology import (
    AdditiveTopology,
    DynamicCombinationTopology,
    GatedResidualTopology,
    MeshTopology,
    StaticCombinationTopology,
)
from tests.conftest import random_ids, tiny_config

B, T, D = 2, 5, 8


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, D, generator=g) for _ in range(4)]


@pytest.mark.parametrize(
    "supplements,expected",
    [
        ((), lambda u, h, h0, e: u),  # base: h <- f(h)
        (("residual",), lambda u, h, h0, e: u + h),
        (("anchor",), lambda u, h, h0, e: u + h0),
        (("anchor_embedding",), lambda u, h, h0, e: u + e),
        (("residual", "anchor", "anchor_embedding"), lambda u, h, h0, e: u + h + h0 + e),
    ],
)
def test_additive_equation_1(supplements, expected):
    emb, pre, u1, u2 = _tensors()
    topo = AdditiveTopology(supplements)
    s0 = topo.start(emb, pre)
    torch.testing.assert_close(s0.h, pre)  # h^(0) = f_pre(h_emb)
    s1 = topo.step(s0, u1, 0)
    torch.testing.assert_close(s1.h, expected(u1, pre, pre, emb))
    s2 = topo.step(s1, u2, 1)
    torch.testing.assert_close(s2.h, expected(u2, s1.h, pre, emb))


def test_gated_residual_starts_as_base_and_uses_rho():
    emb, pre, u1, _ = _tensors()
    topo = GatedResidualTopology(D, 2)
    torch.testing.assert_close(topo.step(topo.start(emb, pre), u1, 0).h, u1)  # ρ = 0 at init
    with torch.no_grad():
        topo.rho[1].fill_(0.5)
    s = topo.start(emb, pre)
    torch.testing.assert_close(topo.step(s, u1, 1).h, u1 + 0.5 * pre)


def test_static_combination_coefficients():
    emb, pre, u1, _ = _tensors()
    topo = StaticCombinationTopology(2)
    with torch.no_grad():
        topo.alpha[0] = torch.tensor([2.0, 3.0, 5.0, 7.0])
    s = topo.start(emb, pre)
    torch.testing.assert_close(topo.step(s, u1, 0).h, 2 * u1 + 3 * pre + 5 * emb + 7 * pre)


def test_dynamic_combination_starts_equal_to_static_and_is_per_token():
    emb, pre, u1, _ = _tensors()
    static, dynamic = StaticCombinationTopology(2), DynamicCombinationTopology(D, 2)
    dynamic.reset_parameters(0.02)
    torch.testing.assert_close(
        dynamic.step(dynamic.start(emb, pre), u1, 0).h, static.step(static.start(emb, pre), u1, 0).h
    )
    with torch.no_grad():
        dynamic.coefficients[0].weight.normal_()
    state = dynamic.start(emb, pre)
    h = dynamic.step(state, u1, 0).h
    alpha = dynamic.coefficients[0](pre)  # computed from h^(t), per token: [B, T, 4]
    torch.testing.assert_close(h, alpha[..., :1] * u1 + alpha[..., 1:2] * pre + alpha[..., 2:3] * emb + alpha[..., 3:] * pre)


def _mesh_reference(topo: MeshTopology, emb, pre, updates_fn, K):
    """Algorithm 2 of mesh.txt, transcribed loop by loop over slots b."""
    Bs = topo.slots
    M = [torch.zeros_like(emb) for _ in range(Bs)]
    M[0] = emb.clone()  # line 6
    w_w = torch.softmax(topo.write[0](pre), -1)  # line 9, t = -1
    w_r = torch.softmax(topo.read[0](pre), -1)
    for b in range(Bs):
        M[b] = M[b] + pre * w_w[..., b : b + 1]  # line 11
    h = sum(M[b] * w_r[..., b : b + 1] for b in range(Bs))  # line 13
    states = [h]
    for t in range(K):
        h_m = updates_fn(h, t)  # line 16
        w_w = torch.softmax(topo.write[t + 1](h), -1)  # line 17: routers of h^(t)
        w_r = torch.softmax(topo.read[t + 1](h), -1)
        for b in range(Bs):
            M[b] = M[b] + h_m * w_w[..., b : b + 1]  # line 20
        h = sum(M[b] * w_r[..., b : b + 1] for b in range(Bs))  # line 22
        states.append(h)
    return states


@pytest.mark.parametrize("slots", [2, 5])
def test_mesh_matches_algorithm_2(slots):
    torch.manual_seed(0)
    K = 3
    emb, pre, _, _ = _tensors()
    topo = MeshTopology(D, K, slots)
    core = torch.nn.Linear(D, D)
    f = lambda h, t: torch.tanh(core(h))  # noqa: E731
    expected = _mesh_reference(topo, emb, pre, f, K)
    state = topo.start(emb, pre)
    got = [state.h]
    for t in range(K):
        state = topo.step(state, f(state.h, t), t)
        got.append(state.h)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert len(state.record["write"]) == K + 1 and state.record["read"][0].shape == (B, T, slots)
    torch.testing.assert_close(state.record["write"][1].sum(-1), torch.ones(B, T))


def test_mesh_router_parameter_count_matches_appendix_e4():
    """(N_loop + 1) · D · B · 2 weights plus biases; Table 6: 61,470 for d=2048, K=2, B=5."""
    d, K, Bs = 64, 2, 5
    topo = MeshTopology(d, K, Bs)
    assert sum(p.numel() for p in topo.parameters()) == (K + 1) * (d * Bs + Bs) * 2
    assert (2 + 1) * (2048 * 5 + 5) * 2 == 61_470


def test_mesh_default_buffer_is_t_plus_3():
    cfg = tiny_config("mesh", layout="1+1R4+1")
    assert LoopLM(cfg).topology.slots == 7


@pytest.mark.parametrize("kind", ["base", "residual", "anchor", "anchor_embedding", "additive"])
def test_test_time_iterations_allowed_without_per_iteration_parameters(kind):
    model = LoopLM(tiny_config(kind)).eval()
    x = random_ids(1, 6)
    out = model(x, iterations=5, output_states=True)
    assert len(out.states) == 6
    assert not torch.allclose(out.logits, model(x).logits)


@pytest.mark.parametrize("kind", ["gated_residual", "static_combination", "dynamic_combination", "mesh"])
def test_test_time_iterations_refused_with_per_iteration_parameters(kind):
    model = LoopLM(tiny_config(kind)).eval()
    with pytest.raises(ConfigError, match="per-iteration parameters"):
        model(random_ids(1, 4), iterations=3)
    model(random_ids(1, 4), iterations=2)  # the trained count is fine


def test_unshared_core_refuses_other_iteration_counts():
    model = LoopLM(tiny_config("mesh", share_core=False))
    assert len(model.core) == 2
    with pytest.raises(ConfigError, match="share_core"):
        model(random_ids(1, 4), iterations=3)


def test_states_and_router_weights_come_from_one_forward():
    model = LoopLM(tiny_config("mesh", layout="1+2R3+1")).eval()
    out = model(random_ids(2, 7), output_states=True)
    assert len(out.states) == 4 and out.states[0].shape == (2, 7, 32)
    assert [w.shape for w in out.record["read"]] == [(2, 7, 6)] * 4
    assert model(random_ids(2, 7)).states is None
