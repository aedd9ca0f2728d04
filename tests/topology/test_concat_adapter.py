"""Huginn's input injection (arXiv 2502.05171 §3.1, Eq. 1): s_i = R(A([s_{i−1}, e])), s_0 random."""

from __future__ import annotations

import math

import pytest
import torch

from looplm import LoopLM
from looplm.config_base import ConfigError
from looplm.topology import ConcatAdapterTopology, TopologyConfig
from tests.conftest import random_ids, tiny_config

B, T, D = 2, 5, 8


def test_core_reads_the_adapter_on_state_and_prelude_output_and_its_output_is_the_next_state():
    g = torch.Generator().manual_seed(0)
    emb, pre, update = (torch.randn(B, T, D, generator=g) for _ in range(3))
    topo = ConcatAdapterTopology(D, state_std=0.5).eval()
    state = topo.start(emb, pre)
    assert torch.equal(state.carrier["e"], pre)  # e travels in the carrier; the embeddings do not
    x = topo.core_input(state, 0)
    W = topo.adapter.weight  # [d, 2d]
    torch.testing.assert_close(x, state.h @ W[:, :D].T + pre @ W[:, D:].T, rtol=1e-6, atol=1e-6)  # A([s, e])
    nxt = topo.step(state, update, 0)
    assert torch.equal(nxt.h, update) and nxt.carrier is state.carrier  # s_1 = R(e, s_0)
    assert torch.equal(topo.finish(nxt), update)  # the coda reads s_r


def test_initial_state_is_a_truncated_normal_in_training_and_one_fixed_draw_at_inference():
    std = 0.7
    topo = ConcatAdapterTopology(64, state_std=std)
    pre = torch.zeros(4, 256, 64)
    torch.manual_seed(0)
    s0 = topo.train().start(pre, pre).h
    assert abs(s0.std().item() - std * 0.986) < 0.02  # a normal truncated at ±3σ keeps 98.6 % of σ
    assert s0.abs().max().item() <= 3 * std
    assert not torch.equal(s0, topo.start(pre, pre).h)  # a fresh draw per training forward
    a, b = topo.eval().start(pre, pre).h, topo.start(pre, pre).h
    assert torch.equal(a, b) and torch.equal(a[0, 0], a[3, 255])  # deterministic, the same at every position
    assert torch.equal(a[0, 0], ConcatAdapterTopology(64, state_std=std).eval_state)  # rebuilt from its seed
    assert "eval_state" not in topo.state_dict()  # not a parameter: checkpoints hold A only


def test_adapter_is_the_only_parameter_and_counted():
    cfg = tiny_config("concat_adapter")
    model = LoopLM(cfg)
    assert [n for n, _ in model.topology.named_parameters()] == ["adapter.weight"]
    assert cfg.topology.parameter_count(cfg.d_model, cfg.iterations) == 2 * cfg.d_model**2
    assert cfg.topology.state_std == pytest.approx(math.sqrt(0.4))


def test_any_iteration_count_runs_at_inference():
    model = LoopLM(tiny_config("concat_adapter", layout="1+1R4+1")).eval()
    ids = random_ids(2, 7)
    with torch.no_grad():
        logits = [model(ids, iterations=r).logits for r in (1, 4, 16)]
    assert logits[0].shape == logits[2].shape and not torch.allclose(logits[0], logits[2])


def test_state_std_must_be_positive():
    with pytest.raises(ConfigError, match="model.topology.state_std"):
        TopologyConfig.from_dict({"kind": "concat_adapter", "state_std": 0})
