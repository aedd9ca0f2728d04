"""build_optimizer: which parameters get weight decay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from looplm import LoopLM
from looplm.train import TrainConfig, build_optimizer
from tests.conftest import tiny_config


def group_names(opt: torch.optim.Optimizer) -> tuple[set[str], set[str]]:
    decay, no_decay = opt.param_groups
    return set(decay["param_names"]), set(no_decay["param_names"])


@pytest.mark.parametrize("topology", ["mesh", "gated_residual", "static_combination", "dynamic_combination"])
def test_matrices_decay_and_norms_biases_gates_do_not(topology):
    model = LoopLM(tiny_config(topology))
    cfg = TrainConfig(weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-7)
    opt = build_optimizer(model, cfg)
    decay, no_decay = group_names(opt)
    matrices = {
        f"{name}.weight" for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))
    }
    assert decay == matrices
    assert "embed.weight" in decay and "head.weight" in decay and "prelude.0.attn.qkv.weight" in decay
    assert all(n.endswith("bias") or "norm" in n or n.startswith("topology.") for n in no_decay)
    assert any(n.endswith("bias") for n in no_decay) and any("norm" in n for n in no_decay)
    if topology == "gated_residual":
        assert "topology.rho" in no_decay  # a [T, d] gate: 2-D, but not a matrix to shrink
    if topology == "static_combination":
        assert "topology.alpha" in no_decay
    if topology == "mesh":
        assert "topology.write.0.weight" in decay and "topology.write.0.bias" in no_decay
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-7 for g in opt.param_groups)
    # every trainable parameter exactly once
    listed = [p for g in opt.param_groups for p in g["params"]]
    assert len({id(p) for p in listed}) == len(listed) == len(list(model.parameters()))


def test_decay_norms_and_biases_decays_everything():
    model = LoopLM(tiny_config("gated_residual"))
    opt = build_optimizer(model, TrainConfig(weight_decay=0.05, decay_norms_and_biases=True))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.05]


def test_tied_embedding_is_one_parameter():
    model = LoopLM(tiny_config("residual", tie_embeddings=True))
    opt = build_optimizer(model, TrainConfig())
    decay, _ = group_names(opt)
    assert "embed.weight" in decay and "head.weight" not in decay
    listed = [p for g in opt.param_groups for p in g["params"]]
    assert sum(p is model.embed.weight for p in listed) == 1
    assert sum(p.numel() for p in listed) == sum(p.numel() for p in model.parameters())


def test_frozen_parameters_are_left_out():
    model = LoopLM(tiny_config("base"))
    model.embed.weight.requires_grad_(False)
    decay, no_decay = group_names(build_optimizer(model, TrainConfig()))
    assert "embed.weight" not in decay | no_decay
