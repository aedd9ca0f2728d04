"""Accounting of the loop axes: streams (passes per macro step), halting (ACT unit and
readout, Q-halt head and its targets-only readout), step embeddings and learned
positions, against the modules that run, hand counts and FlopCounterMode."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from looplm.accounting import (
    analytic_parameter_counts,
    count_flops,
    execution_plan,
    get_convention,
    parameter_counts,
    realised_block_passes,
)
from looplm.accounting.flops import build_meta_model
from looplm.config import load_config, preset_names
from looplm.ladder import RUNGS, rung_model
from looplm.model import LoopLM

BASE = load_config("tiny-base").model  # d = 64, V = 257, LayerNorm, biases
CONVENTIONS = ["default", "mesh", "torch", "spiralformer", "sgt"]


def rung(name: str, budget: int = 12, **changes):
    cfg = dataclasses.replace(BASE, **rung_model(name, budget))
    return dataclasses.replace(cfg, **changes) if changes else cfg


def nested(outer: int = 2, inner: int = 2, steps: int = 2, **changes):
    """A Dual Nested UT with ACT (full compute) and step embeddings: H·(L + 1) passes per step."""
    fields = {"layout": f"1R{steps}", "step_embeddings": True, "topology": {"kind": "base"},
              "streams": {"kind": "two", "outer": outer, "inner": inner},
              "halting": {"kind": "act", "full_compute": True}}
    return dataclasses.replace(BASE, **{**fields, **changes})


AXES = {  # every loop axis alone and combined
    **{f"rung={r}": rung(r) for r in RUNGS},
    "learned-positions": dataclasses.replace(BASE, position="learned"),
    "learned-positions-dense": dataclasses.replace(BASE, position="learned", layout="4"),
    "two-streams-zero-init": nested(streams={"kind": "two", "outer": 2, "inner": 1, "init": "zeros"}),
    "qhalt-single-stream": dataclasses.replace(BASE, layout="1R3", halting={"kind": "qhalt"}),
    "act-anchor-prelude-coda": dataclasses.replace(BASE, topology={"kind": "anchor"}, step_embeddings=True,
                                                    halting={"kind": "act"}, position="learned"),
    "nested-no-grad": nested(outer=3, inner=2, streams={"kind": "two", "outer": 3, "inner": 2,
                                                         "no_grad_cycles": True, "init": "random"}),
}


# ------------------------------------------------------------------ parameters


@pytest.mark.parametrize("name", list(AXES))
def test_parameter_counts_match_modules_and_formula(name):
    cfg = AXES[name]
    model = build_meta_model(cfg)
    counts = parameter_counts(model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts == analytic_parameter_counts(cfg)
    d = cfg.d_model
    assert counts.get("halting", 0) == (d + 1 if cfg.halting.kind != "none" else 0)
    assert counts.get("step_embedding", 0) == (cfg.iterations * d if cfg.step_embeddings else 0)
    learned_init = cfg.streams.kind == "two" and cfg.streams.init == "learned"
    assert counts.get("streams", 0) == (2 * d if learned_init else 0)
    positions = cfg.max_seq_len * d if cfg.position == "learned" else 0
    assert counts["embedding"] == cfg.vocab_size * d + positions  # the position table is embedding
    assert counts["non_embedding"] == counts["total"] - counts["embedding"] - counts["head"]


# ------------------------------------------------------------------ FLOPs by hand


def _terms(conv, rows: int, d: int):
    """FLOPs of rows·d MACs, rows·d additions counted as ``state`` and as ``bias``."""
    return conv.flops_per_mac * rows * d, rows * d * conv.state, rows * d * conv.bias


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("outer,inner", [(1, 1), (1, 2), (2, 3)])
def test_two_stream_flops_are_passes_times_a_core_pass_plus_hand_terms(convention, outer, inner):
    conv, T, steps = get_convention(convention), 64, 3
    cfg = nested(outer, inner, steps)
    passes = outer * (inner + 1)
    assert cfg.passes_per_step == passes
    single = count_flops(dataclasses.replace(BASE, layout="1R1"), T, convention=convention)  # one core pass
    report = count_flops(cfg, T, convention=convention)
    assert report.components["core"] == steps * passes * single.components["core"]
    mac, state, bias = _terms(conv, T, BASE.d_model)
    streams = steps * outer * (2 * inner + 1) * state  # L × (X + Y + Z) and Y + Z per cycle
    step_signal = steps * passes * bias  # x + e_t on every pass's input
    halting = steps * (mac + T * conv.bias + 2 * state)  # unit d -> 1 (+ bias), readout + w·h
    assert report.components["streams"] == streams
    assert report.components["step_embedding"] == step_signal
    assert report.components["halting"] == halting
    rest = single.forward - single.components["core"]  # embedding, prelude, coda, norm, head
    assert report.forward == rest + report.components["core"] + streams + step_signal + halting
    assert "topology" not in report.components  # two streams never call the topology


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_act_costs_exactly_the_halting_unit_and_readout_over_the_tied_model(convention):
    conv, T = get_convention(convention), 48
    act, tied = count_flops(rung("ut_act"), T, convention=convention), count_flops(rung("tied_step"), T, convention=convention)
    mac, state, _ = _terms(conv, T, BASE.d_model)
    per_step = mac + T * conv.bias + 2 * state  # Linear(d, 1) with bias, readout accumulation
    assert act.forward - tied.forward == 12 * per_step
    assert act.components["halting"] == 12 * per_step
    assert {k: v for k, v in act.components.items() if k != "halting"} == tied.components


def test_qhalt_target_readout_counts_only_when_training_once():
    """Q-halt's per-step norm + LM head runs only with targets, under no_grad: not in
    ``forward``, once (not 3×) in ``training``, in ``forward_with_targets``."""
    T = 32
    cfg = rung("ar_trm")
    report = count_flops(cfg, T)
    steps = cfg.iterations
    head = 2 * T * BASE.d_model * BASE.vocab_size
    assert sum(report.targets_only.values()) == steps * head  # default: norms not counted
    assert set(report.targets_only) == {f"halting.target.{m}.{t}" for m in ("norm", "head") for t in range(steps)}
    assert report.components["halting"] == steps * 2 * T * BASE.d_model  # the q head d -> 1
    assert report.training == 3 * report.forward + steps * head
    assert report.forward_with_targets == report.forward + steps * head
    plan = execution_plan(build_meta_model(cfg), T)
    assert not any(s.targets_only for s in plan)  # an inference forward has no target readout
    off = count_flops(dataclasses.replace(cfg, halting={"kind": "qhalt", "loss_weight": 0.0, "full_compute": True}), T)
    assert off.targets_only == {} and off.forward == report.forward
    mesh = count_flops(cfg, T, convention="mesh")  # LayerNorm 5 / element, head 1 / MAC
    assert sum(mesh.targets_only.values()) == steps * (5 * T * BASE.d_model + head // 2)


def test_no_grad_cycles_count_once_in_training():
    """The first H − 1 cycles of each macro step run under no_grad: forward unchanged,
    training counts them once instead of three times."""
    T, steps = 32, 2
    quiet_cfg = nested(3, 2, steps, streams={"kind": "two", "outer": 3, "inner": 2, "no_grad_cycles": True,
                                             "init": "random"})
    grad, quiet = count_flops(nested(3, 2, steps), T), count_flops(quiet_cfg, T)
    assert quiet.forward == grad.forward and grad.no_grad == 0
    per_cycle = (grad.components["core"] + grad.components["streams"] + grad.components["step_embedding"]) / (3 * steps)
    assert quiet.no_grad == pytest.approx(2 * steps * per_cycle)
    assert quiet.training == pytest.approx(grad.training - 2 * quiet.no_grad)
    plan = execution_plan(build_meta_model(quiet_cfg), T)
    passes = quiet_cfg.passes_per_step
    assert passes == 9
    assert {s.slot for s in plan if s.component == "core" and not s.grad} == {
        t * passes + i for t in range(steps) for i in range(2 * 3)}  # cycles 0 and 1 of each step


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_learned_positions_follow_the_token_embedding(convention):
    """The table's lookup is counted as the token embedding's (a one-hot matmul where the
    convention counts one, 2 × forward in training), its addition as a bias."""
    conv, T = get_convention(convention), 40
    rotary, learned = (count_flops(dataclasses.replace(BASE, position=p), T, convention=convention)
                       for p in ("rotary", "learned"))
    d, P, V = BASE.d_model, BASE.max_seq_len, BASE.vocab_size
    lookup = conv.flops_per_mac * T * P * d if conv.embedding else 0
    assert learned.steps["pos_embed"] == lookup + T * d * conv.bias
    assert learned.components["embedding"] == rotary.components["embedding"] + learned.steps["pos_embed"]
    assert learned.embedding_matmul == (conv.flops_per_mac * T * (V + P) * d if conv.embedding else 0)
    others = learned.forward - learned.components["embedding"]
    extra = T * d * conv.bias  # the addition trains like any other op
    assert learned.training == pytest.approx(conv.training_multiplier * (others + extra) + 2 * learned.embedding_matmul)


# ------------------------------------------------------------------ the ladder


@pytest.mark.parametrize("name", RUNGS)
def test_every_rung_plans_the_same_block_passes(name):
    """C = 12 block passes for every rung; tied rungs number their core passes t·passes + i
    as the model names them; every rung spends the same block FLOPs."""
    cfg = rung(name)
    assert cfg.block_passes == 12
    plan = execution_plan(build_meta_model(cfg), 64)
    blocks = [s for s in plan if s.component in ("prelude", "core", "coda")]
    assert len(blocks) == 12
    core = [s for s in blocks if s.component == "core"]
    if core:
        assert sorted(s.slot for s in core) == list(range(12))
        assert all(s.slot // cfg.passes_per_step == s.call.iteration for s in core)
    report = count_flops(cfg, 64)
    dense = count_flops(rung("dense"), 64)
    assert sum(report.components.get(c, 0) for c in ("prelude", "core", "coda")) == dense.components["prelude"]


LADDER_PRESETS = [name for name in preset_names() if name.startswith("ladder-")]


@pytest.mark.parametrize("name", LADDER_PRESETS)
def test_ladder_presets_count_their_budget(name):
    cfg = load_config(name).model
    model = build_meta_model(cfg)
    assert parameter_counts(model) == analytic_parameter_counts(cfg)
    plan = execution_plan(model, 32)
    assert sum(s.component in ("prelude", "core", "coda") for s in plan) == cfg.block_passes


# ------------------------------------------------------------------ FlopCounterMode


def measured(model, x, **kwargs):
    """FlopCounterMode's count of one forward (no backward). Measured with autograd on:
    under ``torch.no_grad`` FlopCounterMode's module tracker fails on StepEmbedding, whose
    forward returns a view of its parameter (requires_grad, no grad_fn)."""
    with FlopCounterMode(display=False) as fc:
        out = model(x, **kwargs)
    return sum(fc.get_flop_counts()["Global"].values()), out


@pytest.mark.parametrize("name", ["dual_nested_ut", "ut_act", "dual_ut", "tied_step", "ar_trm", "nested-H2",
                                  "learned-positions"])
def test_loop_axes_match_flop_counter(name):
    """``torch`` convention = FlopCounterMode with explicit attention (as the existing
    attention-model checks); with targets, Q-halt's target readout is measured too."""
    torch.manual_seed(0)
    if name == "nested-H2":
        cfg = nested(2, 1, 2)
    elif name == "learned-positions":
        cfg = AXES["act-anchor-prelude-coda"]
    else:
        cfg = rung(name, 6)
    model = LoopLM(cfg).eval()
    B, T = 2, 24
    x = torch.randint(0, cfg.vocab_size, (B, T))
    report = count_flops(model, T, batch=B, convention="torch")
    flops, _ = measured(model, x, output_attentions=True)
    assert report.forward == flops
    flops, _ = measured(model, x, targets=torch.randint(0, cfg.vocab_size, (B, T)), output_attentions=True)
    assert report.forward_with_targets == flops
    assert bool(report.targets_only) == (cfg.halting.kind == "qhalt")


def test_realised_block_passes_of_adaptive_act():
    """Adaptive ACT: the forward stops once every position halted; ``output.block_passes``
    gives the mean passes per token, and the measured FLOPs are the plan's at that depth."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(rung("ut_act"), halting={"kind": "act"})  # full_compute off
    model = LoopLM(cfg).eval()
    B, T = 2, 24
    x = torch.randint(0, cfg.vocab_size, (B, T))
    flops, out = measured(model, x, output_attentions=True)
    steps = out.halt_steps
    mean = realised_block_passes(out)
    assert mean == pytest.approx(steps.float().mean().item()) and 1 <= mean < cfg.block_passes
    ran = int(steps.max())  # the batched loop stops when the last position halts
    shorter = dataclasses.replace(cfg, layout=f"1R{ran}", step_embeddings=False)  # e_t adds cost nothing under torch
    assert flops == count_flops(shorter, T, batch=B, convention="torch").forward
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :5] = False
    assert realised_block_passes(out, mask) == pytest.approx(steps[mask].float().mean().item())
    full = LoopLM(rung("ut_act")).eval()
    assert realised_block_passes(full(x)) == cfg.block_passes
    with pytest.raises(ValueError, match="block_passes"):
        realised_block_passes(LoopLM(rung("dense")).eval()(x))
