"""The FLOP counter against torch.utils.flop_counter where a fuzzer over combinations of axes
found it wrong: two streams' no-grad cycles (the earlier macro steps have no backward when
only the last one is read) and SGT head passes under grouped-query attention (only the kv
groups the looping heads read are projected)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from looplm.accounting import count_flops
from looplm.model import LoopLM
from tests.conftest import random_ids, tiny_config

STREAMS = {"kind": "two", "outer": 2, "inner": 1, "no_grad_cycles": True, "init": "random"}


def measured_training(model, B, T):
    model.train()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(random_ids(B, T), targets=random_ids(B, T, seed=1)).loss.backward()
    return fc.get_total_flops()


@pytest.mark.parametrize("halting", [{"kind": "none"}, {"kind": "qhalt", "full_compute": True, "loss_weight": 1.0},
                                     {"kind": "act", "full_compute": True}])
@pytest.mark.parametrize("steps", [1, 3])
def test_no_grad_cycle_training_flops_match_the_flop_counter(halting, steps):
    cfg = tiny_config("base", layout=f"1+1R{steps}", streams=STREAMS, halting=halting)
    torch.manual_seed(0)
    model = LoopLM(cfg)
    B, T = 2, 12
    assert count_flops(model, T, batch=B, convention="torch").training == measured_training(model, B, T)


@pytest.mark.parametrize("weights", [[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.5, 1.0],
                                     [1.0, 1.0, 1.0, 0.0]])
@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_head_pass_flops_match_the_flop_counter(weights, n_kv_heads):
    cfg = tiny_config("anchor", layout="1+1R2+1", n_kv_heads=n_kv_heads, head_loop={"kind": "heads", "heads": 2})
    torch.manual_seed(0)
    model = LoopLM(cfg).eval()
    model.blocks()[1].head_loop.set(2, weights)
    B, T = 2, 12
    with FlopCounterMode(display=False) as fc:
        model(random_ids(B, T), output_attentions=True)
    assert count_flops(model, T, batch=B, convention="torch").forward == fc.get_total_flops()


#: halting rules and topologies whose small heads run a backward that is a weight gradient
#: only (their input carries no gradient) or none at all (their output reaches no loss)
PARTIAL_BACKWARD = {
    # the gate's λ only selects the readout (a mask): no gradient reaches the gate or its norm
    "exit-gate-readout": dict(layout="1+1R3", halting={"kind": "exit_gate", "threshold": 0.5}),
    "exit-gate-expected": dict(layout="1+1R3", halting={"kind": "exit_gate", "objective": "expected"}),
    # Ouro Stage II: the LM frozen, the gate's input has no gradient
    "exit-gate-improvement": dict(layout="1+1R3", halting={"kind": "exit_gate", "objective": "improvement"}),
    # q only decides halting (a comparison): no loss reads it
    "qhalt-loss-weight-0": dict(layout="1+1R3", halting={"kind": "qhalt", "loss_weight": 0.0}),
    "qhalt-full-compute-loss-weight-0": dict(layout="1+1R3", halting={"kind": "qhalt", "loss_weight": 0.0,
                                                                       "full_compute": True}),
    "qhalt": dict(layout="1+1R3", halting={"kind": "qhalt"}),
    # MoR's auxiliary router reads the detached state
    "mor-aux-router": dict(layout="1+1R3+1", halting={"kind": "mor", "auxiliary": "router", "init_bias": 0.0}),
    # the state entering a truncated backward's window has no gradient: the coefficients'
    # linear on it computes its weight gradient only
    "dynamic-combination-window": dict(layout="1+1R3+1", depth={"kind": "fixed", "backprop_window": 2}),
}


@pytest.mark.parametrize("name", list(PARTIAL_BACKWARD))
def test_heads_with_a_partial_backward_are_counted_as_it_runs(name):
    kw = dict(PARTIAL_BACKWARD[name])
    topology = "dynamic_combination" if name.startswith("dynamic") else "anchor"
    cfg = tiny_config(topology, **kw)
    torch.manual_seed(0)
    model = LoopLM(cfg)
    B, T = 2, 12
    assert count_flops(model, T, batch=B, convention="torch").training == measured_training(model, B, T)
