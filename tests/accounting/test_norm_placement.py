"""Accounting of the block's norm placement, the loop-input norm and the exit gate: the
analytic parameter count equals the modules' over the whole config grid, and the FLOP
counter adds exactly the extra norms and gates that run."""

from __future__ import annotations

import dataclasses

import pytest

from looplm.accounting import analytic_parameter_counts, count_flops, get_convention, parameter_counts
from looplm.accounting.flops import build_meta_model
from tests.conftest import all_configs, tiny_config


@pytest.mark.parametrize("name,cfg", all_configs(), ids=[n for n, _ in all_configs()])
def test_analytic_parameters_equal_the_modules(name, cfg):
    assert analytic_parameter_counts(cfg) == parameter_counts(build_meta_model(cfg))


@pytest.mark.parametrize("norm,per_element", [("rmsnorm", 4), ("layernorm", 5)])
def test_sandwich_adds_two_norms_per_block_pass(norm, per_element):
    pre = tiny_config("anchor", layout="1+2R3+1", norm=norm)
    sandwich = dataclasses.replace(pre, norm_placement="sandwich")
    seq, batch, d = 16, 2, pre.d_model
    extra = pre.block_passes * 2 * batch * seq * d * per_element
    assert count_flops(sandwich, seq, batch=batch, convention="mesh").forward == \
        count_flops(pre, seq, batch=batch, convention="mesh").forward + extra
    # norms are left out by the default convention: the same count
    assert count_flops(sandwich, seq, batch=batch).forward == count_flops(pre, seq, batch=batch).forward
    counts, before = parameter_counts(build_meta_model(sandwich)), parameter_counts(build_meta_model(pre))
    norm_params = d * (2 if norm == "layernorm" else 1)
    blocks = 1 + 2 + 1  # prelude, shared core, coda
    assert counts["total"] == before["total"] + blocks * 2 * norm_params


def test_loop_input_norm_counts_one_final_norm_per_later_step():
    pre = tiny_config("base", layout="2R4", norm="rmsnorm", mlp="swiglu", bias=False)
    looped = dataclasses.replace(pre, loop_input_norm=True)
    seq, batch, d = 8, 3, pre.d_model
    a = count_flops(looped, seq, batch=batch, convention="mesh")
    b = count_flops(pre, seq, batch=batch, convention="mesh")
    assert a.components["final_norm"] == b.components["final_norm"] + 3 * batch * seq * d * 4
    assert a.forward - b.forward == 3 * batch * seq * d * 4
    assert parameter_counts(build_meta_model(looped)) == parameter_counts(build_meta_model(pre))  # the shared norm


def test_exit_gate_counts_its_norm_gate_and_selection_every_step():
    pre = tiny_config("base", layout="2R3", norm="rmsnorm", mlp="swiglu", bias=False)
    gated = dataclasses.replace(pre, halting={"kind": "exit_gate", "threshold": 0.5})
    seq, batch, d = 8, 2, pre.d_model
    rows = seq * batch
    a = count_flops(gated, seq, batch=batch, convention="mesh")  # 1 FLOP / MAC, norms and biases counted
    b = count_flops(pre, seq, batch=batch, convention="mesh")
    per_step = rows * d * 4 + rows * d + rows + rows * d  # norm(Y), the gate d -> 1 and its bias, the selection
    assert a.forward - b.forward == 3 * per_step
    assert analytic_parameter_counts(gated)["halting"] == d + 1 == parameter_counts(build_meta_model(gated))["halting"]


@pytest.mark.parametrize("convention,per_mac", [("default", 2), ("mesh", 1)])
def test_expected_objective_counts_a_trained_head_every_step_and_an_untrained_readout(convention, per_mac):
    """Ouro's Stage I objective reads head(norm(Y_t)) at every step with gradient (on the
    norm the gate already reads), and the readout's final norm and head then run without
    backward. Under the readout objective no loss reaches the gates or their norms (λ only
    selects the readout); under the expected one every gate but the last does (p(T) reads
    no λ_T) and every step's norm (its head reads it). Hand count: H = per_mac·rows·d·V per
    head call, N the final norm, G and N_s one step's gate and norm."""
    readout = tiny_config("base", layout="2R3", norm="rmsnorm", mlp="swiglu", bias=False,
                          halting={"kind": "exit_gate", "threshold": 0.5})
    expected = dataclasses.replace(readout, halting={"kind": "exit_gate", "threshold": 0.5, "objective": "expected"})
    seq, batch, steps = 8, 2, 3
    rows, d, V = seq * batch, readout.d_model, readout.vocab_size
    head = per_mac * rows * d * V
    norm = rows * d * 4 if convention == "mesh" else 0  # RMSNorm: 4 per element where norms count
    a = count_flops(expected, seq, batch=batch, convention=convention)
    b = count_flops(readout, seq, batch=batch, convention=convention)
    m = get_convention(convention).training_multiplier
    assert a.forward == b.forward  # an inference forward is the same
    assert b.targets_only == {} and b.targets_only_grad == 0
    assert a.targets_only == {f"halting.target.head.{t}": head for t in range(steps)}
    assert a.targets_only_grad == steps * head
    assert a.forward_with_targets == a.forward + steps * head
    # training: every step's head m times; the readout's norm + head once instead of m times;
    # the gates but the last and every step's norm m times instead of once
    gate, step_norm = a.steps["halting.0"], a.steps["halting.norm.0"]
    assert a.training == (b.training + m * steps * head - (m - 1) * (head + norm)
                          + (m - 1) * ((steps - 1) * gate + steps * step_norm))


def test_expected_objective_targets_only_flops_match_flop_counter():
    """FlopCounterMode (matmuls) over a forward given targets: the per-step heads are there."""
    from torch.utils.flop_counter import FlopCounterMode

    from looplm.model import LoopLM
    from tests.conftest import random_ids

    cfg = tiny_config("base", layout="1R3", norm="rmsnorm", mlp="swiglu", bias=False,
                      halting={"kind": "exit_gate", "objective": "expected"})
    model = LoopLM(cfg)
    x, y = random_ids(2, 10), random_ids(2, 10, seed=1)
    report = count_flops(model, 10, batch=2, convention="torch")
    with FlopCounterMode(display=False) as fc:
        model(x, y, output_attentions=True)
    assert report.forward_with_targets == sum(fc.get_flop_counts()["Global"].values())
