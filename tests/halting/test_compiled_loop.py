"""A compiled forward of an adaptive-halting loop (LoopLM._recur): no "all halted?" exit,
which reads the device back, so the training step is one graph (what CUDA graphs need), and
the frozen steps it runs instead change nothing: the loss and every gradient are eager's,
where eager stops early."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopLM
from tests.conftest import random_ids, tiny_config

#: halting rules that freeze positions (the ones whose eager loop may stop early), each with a
#: starting bias that halts every position after the first step, so eager does stop early
HALTING = {
    "act": {"kind": "act", "init_bias": 6.0},
    "qhalt": {"kind": "qhalt", "init_bias": 6.0},  # reads its target from the solution: no coda
    "mor-expert": {"kind": "mor", "depths": 3, "init_bias": -6.0},
    "mor-token-recursion": {"kind": "mor", "depths": 3, "routing": "token_choice", "kv": "recursion"},
    "mor-expert-shared-skip": {"kind": "mor", "depths": 3, "init_bias": 0.0, "kv": "shared"},
}


def steps_run(model: LoopLM, run) -> int:
    """Core passes made during ``run()``."""
    calls = []
    hook = model.core[0][0].register_forward_pre_hook(lambda mod, args: calls.append(1))
    try:
        run()
    finally:
        hook.remove()
    return len(calls)


@pytest.mark.parametrize("name", sorted(HALTING))
def test_compiled_adaptive_loop_is_one_graph_with_eagers_loss_and_gradients(name):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    layout = "1+1R3" if name == "qhalt" else "1+1R3+1"
    model = LoopLM(tiny_config("anchor", layout=layout, halting=HALTING[name])).train()
    if name == "mor-token-recursion":  # every position picks depth 1: nobody takes step 1
        with torch.no_grad():
            model.halting.router.bias.copy_(torch.tensor([6.0, 0.0, 0.0]))
    params = [p for p in model.parameters() if p.requires_grad]
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda ids: model(ids, targets=ids), backend="aot_eager", fullgraph=True)
    for seed in range(2):
        x = random_ids(2, 12, seed=seed)
        eager = model(x, targets=x)
        if name != "mor-expert-shared-skip":  # the eager loop stopped before its last step
            assert steps_run(model, lambda: model(x, targets=x)) < 3
        compiled = step(x)
        torch.testing.assert_close(compiled.loss, eager.loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(compiled.logits, eager.logits, atol=2e-6, rtol=1e-5)
        assert torch.equal(compiled.halt_steps, eager.halt_steps)
        # a rule's module that eager's early stop never called (a later step's router) gets
        # a zero gradient from the compiled full loop: the same update
        for p, a, b in zip(params, torch.autograd.grad(compiled.loss, params, allow_unused=True),
                           torch.autograd.grad(eager.loss, params, allow_unused=True)):
            zero = torch.zeros_like(p)
            torch.testing.assert_close(zero if a is None else a, zero if b is None else b, atol=2e-6, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_zero_shot_exit_is_one_graph_with_eagers_logits():
    """Zero-shot exit (an inference rule: KL between successive steps' distributions) under
    a generous threshold stops eager's loop early; the compiled forward runs every step,
    positions that stopped frozen, with the same logits and exit steps."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = LoopLM(tiny_config("anchor", layout="1+1R3+1", init_std=0.3,
                               halting={"kind": "convergence", "criterion": "kl", "threshold": 10.0})).eval()
    x = random_ids(2, 12)
    assert steps_run(model, lambda: model(x)) < 3
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda ids: model(ids), backend="aot_eager", fullgraph=True)(x)
    eager = model(x)
    torch.testing.assert_close(compiled.logits, eager.logits, atol=2e-6, rtol=1e-5)
    assert torch.equal(compiled.halt_steps, eager.halt_steps)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
