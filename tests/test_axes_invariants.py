"""DESIGN.md invariants 1-2 (strict causality, cache equivalence) over combinations of the
model's axes at once: topology × layout (looped, dense, multi-resolution) × mixer × block
shape × step signal × streams × halting × LoRA × MoE × truncated backprop. The named grid
(tests/conftest.py:all_configs) holds one configuration per mechanism; combinations are where
a random search found what it missed (a multi-resolution layout accepted on a topology that
replaces the state, a test-time count past the loop-level mixers, a drawn depth with
per-iteration adapters). A combination looplm refuses must be refused at config load with a
ConfigError naming a ``model.`` field; one it accepts must keep both invariants."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from looplm import LoopLM
from looplm.config_base import ConfigError
from tests.conftest import TOPOLOGY_KINDS, random_ids, relax_adapters, tiny_config
from tests.invariants import (
    assert_decodes_like_full_forward,
    assert_static_decodes_like_full_forward,
    assert_strictly_causal,
    prefill_then_tokens,
)

MIXERS = [{"kind": "attention"}, {"kind": "attention", "output_gate": True}, {"kind": "sliding_window", "window": 3},
          {"kind": "gated_deltanet"}, {"kind": "mamba2"}, {"kind": "retnet"}]
SOFTMAX = MIXERS[:3]
TOPOLOGIES = sorted({*TOPOLOGY_KINDS, "additive", "concat_adapter"})
#: the kinds that add the update to a state: the ones a sub-token iteration accepts
ADDING = ["anchor", "anchor_embedding", "residual", "mesh", "additive", "static_combination", "dynamic_combination"]
HALTING = [{"kind": "act", "ponder_cost": 0.1}, {"kind": "qhalt"}, {"kind": "exit_gate", "threshold": 0.5},
           {"kind": "mor", "init_bias": 0.0}, {"kind": "mor", "init_bias": 0.0, "routing": "token_choice",
                                                "kv": "recursion"}, {"kind": "mor", "init_bias": 0.0, "kv": "shared"}]


@st.composite
def axes(draw) -> dict:
    """tiny_config keyword arguments drawn across every axis at once, steered towards
    combinations looplm accepts (a few refused ones remain, and must be refused cleanly)."""
    shape = draw(st.sampled_from(["looped", "looped", "looped", "dense", "multires"]))
    prelude, core, coda = draw(st.integers(0, 1)), draw(st.integers(1, 2)), draw(st.integers(0, 1))
    kw = {"mixer": draw(st.sampled_from(MIXERS)), "n_kv_heads": draw(st.sampled_from([None, 2])),
          "norm_placement": draw(st.sampled_from(["pre", "pre", "sandwich"])),
          "position": draw(st.sampled_from(["rotary", "rotary", "learned"]))}
    if draw(st.booleans()):
        kw.update(norm="rmsnorm", mlp="swiglu", bias=False)
    if shape == "dense":
        kw.update(topology="base", layout=str(core + 1))
        iterations = 0
    elif shape == "multires":
        schedule = draw(st.sampled_from(["{1/2,1}", "{1/4,1/2,1}", "{1,1/2}"]))
        kw.update(topology=draw(st.sampled_from([*ADDING, *TOPOLOGIES])), layout=f"{prelude}+{core}x{schedule}+{coda}")
        iterations = 0  # one resolution per iteration: no halting, streams or drawn counts
    else:
        iterations = draw(st.integers(1, 3))
        kw.update(topology=draw(st.sampled_from(TOPOLOGIES)), layout=f"{prelude}+{core}R{iterations}+{coda}",
                  share_core=draw(st.booleans()), step_embeddings=draw(st.booleans()))
    if iterations:
        extra = draw(st.sampled_from(["none", "none", "halting", "halting", "streams", "lora", "window"]))
        if extra == "halting":
            halting = dict(draw(st.sampled_from(HALTING)))
            if halting["kind"] == "mor":
                if iterations == 1 or kw["topology"] == "mesh":
                    kw["layout"] = f"{prelude}+{core}R{max(iterations, 2)}+{coda}"
                    kw["topology"] = "anchor"
                halting["depths"] = max(iterations, 2)
                if halting.get("kv", "all") != "all":
                    kw["mixer"] = draw(st.sampled_from(SOFTMAX))
            kw["halting"] = halting
        elif extra == "streams":
            kw.update(topology="base", share_core=True,
                      streams={"kind": "two", "outer": draw(st.integers(1, 2)), "inner": draw(st.integers(1, 2)),
                               "init": draw(st.sampled_from(["learned", "random", "zeros"])),
                               "no_grad_cycles": draw(st.booleans())})
        elif extra == "lora":
            kw.update(share_core=True, lora={"rank": 2, "targets": ["mlp"]})
        elif extra == "window":
            kw["depth"] = {"kind": "fixed", "backprop_window": 1}
    if draw(st.integers(0, 4)) == 0:
        kw["moe"] = {"experts": 3, "top_k": draw(st.integers(1, 2)), "hidden": 24,
                     "per_iteration": bool(iterations) and draw(st.booleans())}
    return kw


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(kw=axes(), prefill=st.sampled_from([1, 6]))
def test_every_accepted_combination_keeps_causality_and_cache_equivalence(kw, prefill):
    kw = dict(kw)
    try:
        cfg = tiny_config(kw.pop("topology"), **kw)
    except ConfigError as err:  # refused at load, naming the field
        assert err.field.startswith("model."), err
        event(f"refused: {err.field}")
        return
    event("built")
    torch.manual_seed(0)
    model = LoopLM(cfg).eval()
    relax_adapters(model)
    assert_strictly_causal(model, random_ids(2, 13), (0, 6, 12), shift=7, vocab=cfg.vocab_size)
    assert_decodes_like_full_forward(model, random_ids(2, 13), [prefill_then_tokens(prefill, 13)], atol=2e-5)
    assert_decodes_like_full_forward(model, random_ids(2, 12), [[5, 9, 12]], atol=2e-5)
    reason = assert_static_decodes_like_full_forward(model, random_ids(2, 13), [6, 7, 8, 11, 12, 13], atol=2e-5,
                                                     capacity=20)
    assert reason is None, reason
