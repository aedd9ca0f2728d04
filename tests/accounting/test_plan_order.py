"""The execution plan runs the forward's module calls in the forward's order.

The plan is read from the axes' step descriptions (``streams.step_calls``,
``halting.step_calls``, ``resolution.pass_calls``, ``topology.start_calls/step_calls``,
``LoopLM._pass_calls``), written beside the code they describe but not run by it. This
test holds the two together: it records a real forward's top-level module calls (forward
hooks on every module; the topology's ``start``/``step``, which are methods, wrapped; the
addition of the step signal e_t, which calls no module, seen by a TorchFunctionMode as an
addition of the row ``step_embedding.at(t)`` returned) and compares them, call by call,
with the plan's steps, over every value of every loop axis (layouts × topologies × halting
rules × streams × resolution × step embeddings × loop_input_norm × head_loop). A two-stream
sum (``streams.*``) adds loop states and calls no module: no hook sees it. Every other step
must be met by exactly one recorded call of its module (or a module inside it), and every
recorded call of a module with parameters must be a plan step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.overrides import TorchFunctionMode

from looplm.accounting.plan import PositionCall, Step, execution_plan
from looplm.config import load_config
from looplm.config_base import ConfigError
from looplm.model import LoopLM

BASE = dataclasses.replace(load_config("tiny-base").model, norm="rmsnorm", bias=False, max_seq_len=64)
T = 32  # every multi-resolution iteration below completes chunks at this length

#: the values of each axis (a field of ModelConfig and what it is set to)
LAYOUTS = {"dense": dict(layout="2"), "looped": dict(layout="1R3"), "prelude-coda": dict(layout="1+1R2+1"),
           "unshared": dict(layout="1+2R2+1", share_core=False),
           "multires": dict(layout="1+1x{1/8,1/4,1/2,1}+1")}
TOPOLOGIES = [{"kind": k} for k in ("base", "residual", "anchor", "anchor_embedding", "gated_residual",
                                    "static_combination", "dynamic_combination", "mesh",
                                    "concat_adapter")] + [
    {"kind": "additive", "supplements": ["residual", "anchor_embedding"]}]
HALTING = [{"kind": "none"}, {"kind": "act", "full_compute": True}, {"kind": "qhalt", "full_compute": True},
           {"kind": "exit_gate"}, {"kind": "exit_gate", "objective": "expected"},
           {"kind": "exit_gate", "objective": "improvement"},
           {"kind": "convergence", "criterion": "entropy", "threshold": 1e-9},  # never fires: every step runs
           # Mixture-of-Recursions: its routers start every position at full depth (init_bias)
           {"kind": "mor", "depths": 3}, {"kind": "mor", "depths": 3, "routing": "token_choice"},
           {"kind": "mor", "depths": 3, "routing": "expert_choice", "auxiliary": "router"},
           {"kind": "mor", "depths": 3, "kv": "shared"}]
STREAMS = [{"kind": "single"}, {"kind": "two", "outer": 2, "inner": 1},
           {"kind": "two", "outer": 2, "inner": 2, "no_grad_cycles": True, "init": "zeros"}]
RESOLUTIONS = [{"down": "mean", "up": "uniform"}, {"down": "aggregate", "up": "router"}]
LORAS = [{"rank": 2}, {"rank": 1, "targets": ["mlp"]}]
HEAD_LOOPS = [None, {"kind": "heads", "heads": 2, "max_depth": 2, "layers": 1, "start": 10, "interval": 10},
              {"kind": "block", "max_depth": 1, "layers": 1, "start": 10, "interval": 10}]

#: steps that add loop states without calling a module or reading a parameter
UNHOOKED = ("streams",)
ADDS = (torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.add)


def _owner(step: Step) -> nn.Module:
    """The module whose call (or a call inside it) realises ``step``."""
    return step.module.table if isinstance(step.module, PositionCall) else step.module


def planned_calls(model: LoopLM, targets: bool) -> list[tuple[str, nn.Module]]:
    """(step name, owner) of every plan step a hook can see, in plan order. A step whose
    module lies inside another step's (an auxiliary router, a topology's coefficients:
    listed apart for their backward) runs within that step's call."""
    plan = execution_plan(model, T, 2, targets=targets)
    inner = {id(m) for s in plan for m in _owner(s).modules() if m is not _owner(s)}
    return [(s.name, _owner(s)) for s in plan
            if s.component not in UNHOOKED and (targets or not s.targets_only) and s.call.tokens > 0
            and id(_owner(s)) not in inner]


@contextlib.contextmanager
def recorded_calls(model: LoopLM, owners: dict[int, nn.Module]):
    """Record the owners of the forward's top-level module calls (calls made inside another
    recorded call belong to it) into the yielded list; an owned module is one of
    ``owners`` (id of every module under a plan step's owner -> that owner)."""
    calls: list[nn.Module] = []
    depth = [0]
    unowned: list[str] = []

    def enter(module, *args):
        if depth[0] == 0:
            owner = owners.get(id(module))
            if owner is not None:
                calls.append(owner)
            elif any(True for _ in module.parameters()):
                unowned.append(type(module).__name__)
        depth[0] += 1

    def leave(module, *args):
        depth[0] -= 1

    def wrapped(method, module):
        @functools.wraps(method)
        def run(*args, **kwargs):
            enter(module)
            try:
                return method(*args, **kwargs)
            finally:
                leave(module)
        return run

    signals: list[torch.Tensor] = []  # the rows e_t handed out by step_embedding.at

    def signal_at(t):
        row = type(model.step_embedding).at(model.step_embedding, t)
        if row is not None:
            signals.append(row)
        return row

    class SignalAdds(TorchFunctionMode):
        """An addition of a row e_t at the top level is the step embedding's call."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if depth[0] == 0 and func in ADDS and any(a is e for a in args for e in signals):
                calls.append(model.step_embedding)
            return func(*args, **(kwargs or {}))

    pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
    post = torch.nn.modules.module.register_module_forward_hook(leave)
    try:
        if model.topology is not None:
            model.topology.start = wrapped(model.topology.start, model.topology)
            model.topology.step = wrapped(model.topology.step, model.topology)
        if model.step_embedding is not None:
            model.step_embedding.at = signal_at
        with SignalAdds():
            yield calls
    finally:
        pre.remove()
        post.remove()
        if model.topology is not None:
            del model.topology.start, model.topology.step
        if model.step_embedding is not None:
            del model.step_embedding.at
    assert unowned == [], f"modules with parameters called outside every plan step: {unowned}"


def check_plan_order(cfg) -> None:
    torch.manual_seed(0)
    model = LoopLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, T))
    for targets in (False, True):
        planned = planned_calls(model, targets)
        owners = {id(m): owner for _, owner in planned for m in owner.modules()}
        with torch.no_grad(), recorded_calls(model, owners) as calls:
            model.forward(ids, torch.roll(ids, -1, dims=1) if targets else None)  # the model's own call unrecorded
        names = {id(owner): name for name, owner in planned}
        got = [names.get(id(m), type(m).__name__) for m in calls]
        want = [name for name, _ in planned]
        # the recorded call's owner is the planned step's module, call by call
        mismatch = next((i for i, (a, (_, m)) in enumerate(zip(calls, planned)) if a is not m), None)
        assert mismatch is None and len(calls) == len(planned), (
            f"targets={targets}: first difference at call {mismatch}\nplan:    {want}\nforward: {got}")


def _config(layout="looped", topology=None, halting=None, streams=None, resolution=None, step_embeddings=False,
            loop_input_norm=False, head_loop=None, lora=None, depth=None, moe=None):
    fields = dict(LAYOUTS[layout], step_embeddings=step_embeddings, loop_input_norm=loop_input_norm,
                  head_loop=head_loop, moe=moe)
    if lora is not None:
        fields["lora"] = lora
    if depth is not None:
        fields["depth"] = depth
    if layout != "dense":
        fields.update(topology=topology or {"kind": "base"}, halting=halting or {"kind": "none"},
                      streams=streams or {"kind": "single"})
    if resolution is not None:
        fields["resolution"] = resolution
    return dataclasses.replace(BASE, **fields)


# every value of every axis, on a loop with the other axes on where they combine
AXIS_VALUES = {
    **{f"layout={k}": dict(layout=k, topology={"kind": "anchor"}) for k in LAYOUTS},
    **{f"topology={t['kind']}": dict(topology=t, step_embeddings=True) for t in TOPOLOGIES},
    **{f"halting={h['kind']}-{h.get('objective', h.get('routing', ''))}": dict(halting=h, loop_input_norm=True)
       for h in HALTING},
    **{f"streams={i}": dict(streams=s, step_embeddings=True, halting=HALTING[1])
       for i, s in enumerate(STREAMS)},
    **{f"resolution={r['down']}-{t}": dict(layout="multires", topology={"kind": t}, resolution=r,
                                            step_embeddings=True, loop_input_norm=t == "anchor")
       for r in RESOLUTIONS for t in ("anchor", "mesh")},
    **{f"head_loop={h and h['kind']}": dict(layout="prelude-coda", head_loop=h, loop_input_norm=True)
       for h in HEAD_LOOPS},
    "step_embeddings+loop_input_norm": dict(layout="unshared", step_embeddings=True, loop_input_norm=True),
    "mesh-unshared": dict(layout="unshared", topology={"kind": "mesh"}, loop_input_norm=True),
    "qhalt-step-embeddings": dict(topology={"kind": "anchor"}, halting=HALTING[2], step_embeddings=True),
    **{f"lora={i}-{layout}": dict(layout=layout, topology=None if layout == "looped" else {"kind": "anchor"},
                                  lora=lora, step_embeddings=True,
                                  streams=STREAMS[1] if layout == "looped" else None)
       for i, lora in enumerate(LORAS) for layout in ("prelude-coda", "multires", "looped")},
    "concat_adapter-sampled-depth": dict(layout="prelude-coda", topology={"kind": "concat_adapter"},
                                         depth={"kind": "lognormal_poisson", "backprop_window": 1}),
    # the block's FFN as a mixture of experts: shared, and one expert set per iteration
    "moe=shared": dict(layout="prelude-coda", topology={"kind": "mesh"}, moe={"experts": 4, "top_k": 2}),
    "moe=per_iteration": dict(layout="prelude-coda", moe={"experts": 4, "top_k": 1, "per_iteration": True}),
}


@pytest.mark.parametrize("name", list(AXIS_VALUES))
def test_plan_order_matches_the_forward(name):
    check_plan_order(_config(**AXIS_VALUES[name]))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(layout=st.sampled_from(sorted(LAYOUTS)), topology=st.sampled_from(TOPOLOGIES),
       halting=st.sampled_from(HALTING), streams=st.sampled_from(STREAMS),
       resolution=st.sampled_from(RESOLUTIONS), step_embeddings=st.booleans(), loop_input_norm=st.booleans(),
       head_loop=st.sampled_from(HEAD_LOOPS))
def test_plan_order_matches_the_forward_on_combined_axes(layout, topology, halting, streams, resolution,
                                                         step_embeddings, loop_input_norm, head_loop):
    """Combinations the configuration accepts (a refused one is drawn again)."""
    try:
        cfg = _config(layout, topology, halting, streams, resolution if layout == "multires" else None,
                      step_embeddings and layout != "dense", loop_input_norm and layout != "dense", head_loop)
    except ConfigError:
        assume(False)
    check_plan_order(cfg)


def test_the_order_check_sees_a_plan_that_drifts(monkeypatch):
    """Not vacuous: a halting rule whose description leaves out its module call, and one
    that lists its norm after its gate, are both caught."""
    cfg = _config(halting={"kind": "exit_gate"})
    from looplm.halting.exit_gate import ExitGateHalting

    monkeypatch.setattr(ExitGateHalting, "step_calls", lambda self, t, call, readout, targets: [])
    with pytest.raises(AssertionError, match="outside every plan step"):
        check_plan_order(cfg)
    monkeypatch.setattr(ExitGateHalting, "step_calls", lambda self, t, call, readout, targets: [
        Step("halting", f"halting.{t}", self, call), Step("final_norm", f"halting.norm.{t}", readout.norm, call)])
    with pytest.raises(AssertionError, match="first difference"):
        check_plan_order(cfg)
