"""Mixture-of-Recursions' token skipping (``model.halting.skip``, looplm.halting.mor): a later
step runs its blocks on the gathered positions taking it, and gives the frozen path's logits,
losses and gradients, across routing, selection, KV policy and the other loop axes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from looplm import LoopCache, LoopLM
from looplm.config_base import ConfigError
from looplm.mixers.base import GatheredRows
from tests.conftest import random_ids, tiny_config
from tests.invariants import assert_decodes_like_full_forward, assert_strictly_causal, prefill_then_tokens

D = 8


def build(halting: dict, skip: bool, topology: str = "anchor", **fields) -> LoopLM:
    """A tiny MoR model whose routers have O(1) weights and zero biases (positions leave at
    different steps); the same weights whatever ``skip``."""
    torch.manual_seed(0)
    std = fields.pop("router_std", 1.0 / D ** 0.5)
    m = LoopLM(tiny_config(topology, layout=fields.pop("layout", "1+1R3+1"),
                           halting={"kind": "mor", "depths": 3, **halting, "skip": skip}, **fields))
    with torch.no_grad():
        for name, p in m.halting.named_parameters():
            p.normal_(0.0, std) if name.endswith("weight") else p.zero_()
    return m


def rows_seen(m: LoopLM, run) -> list[int]:
    """The sequence length each call of the first core block saw during ``run()``."""
    seen = []
    hook = m.core[0][0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    try:
        run()
    finally:
        hook.remove()
    return seen


def train_step(m: LoopLM, x: torch.Tensor, mask: torch.Tensor):
    torch.manual_seed(1)  # the same draws for both paths (Huginn's random latent state)
    out = m(x, targets=x, attention_mask=mask)
    out.loss.backward()
    return out, {name: p.grad for name, p in m.named_parameters() if p.grad is not None}


def assert_skipping_equals_frozen(halting: dict, topology: str = "anchor", padded: bool = True, **fields):
    skipping, frozen = (build(halting, skip, topology, **dict(fields)).train() for skip in (True, False))
    x = random_ids(3, 15)
    mask = torch.ones(3, 15, dtype=torch.long)
    if padded:
        mask[0, :4] = 0
    stepped = []
    seen = rows_seen(skipping, lambda: stepped.append(train_step(skipping, x, mask)))
    (out, grads), = stepped
    ref, ref_grads = train_step(frozen, x, mask)
    assert len(ref.halt_steps[mask.bool()].unique()) > 1, "positions should leave at different steps"
    assert seen[0] == 15 and min(seen[1:]) < 15, f"a later step should run on fewer rows: {seen}"
    torch.testing.assert_close(out.logits, ref.logits, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, atol=2e-6, rtol=1e-6)
    assert sorted(out.aux_losses) == sorted(ref.aux_losses)
    for name in ref.aux_losses:
        torch.testing.assert_close(out.aux_losses[name], ref.aux_losses[name], atol=1e-6, rtol=1e-6)
    assert torch.equal(out.halt_steps, ref.halt_steps) and torch.equal(out.block_passes, ref.block_passes)
    assert sorted(grads) == sorted(ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=2e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


#: routing × selection × KV policy, with the other loop axes the KV policies allow
CASES = {
    "expert-threshold-recursion": (dict(kv="recursion"), "anchor", {}),
    "expert-top-k-recursion": (dict(kv="recursion", selection="top_k"), "anchor", {}),
    "expert-threshold-shared": (dict(kv="shared"), "anchor", {}),
    "expert-top-k-shared": (dict(kv="shared", selection="top_k"), "residual", {}),
    "token-recursion": (dict(kv="recursion", routing="token_choice"), "anchor", {}),
    "token-shared": (dict(kv="shared", routing="token_choice"), "anchor", {}),
    "expert-recursion-window": (dict(kv="recursion"), "gated_residual",
                                dict(mixer={"kind": "sliding_window", "window": 4})),
    "expert-shared-window-gqa-gate": (dict(kv="shared"), "residual",
                                      dict(mixer={"kind": "sliding_window", "window": 4, "output_gate": True},
                                           n_kv_heads=2, norm="rmsnorm", bias=False)),
    "expert-auxiliary-router-capacity": (dict(kv="recursion", auxiliary="router", capacity=[0.5, 0.25]),
                                         "anchor", {}),
    "token-recursion-static-combination-steps": (dict(kv="recursion", routing="token_choice"), "static_combination",
                                   dict(step_embeddings=True)),
    "expert-recursion-two-streams": (dict(kv="recursion"), "base",
                                     # the solution stream starts from Y⁰ = 0: larger router weights
                                     dict(streams={"kind": "two", "outer": 1, "inner": 1, "init": "zeros"},
                                          router_std=3.0)),
    "expert-shared-loop-input-norm-swiglu": (dict(kv="shared"), "anchor",
                                             dict(loop_input_norm=True, mlp="swiglu", norm="rmsnorm", bias=False)),
    "token-recursion-two-core-blocks": (dict(kv="recursion", routing="token_choice"), "anchor",
                                        dict(layout="1+2R3+1")),
    "expert-recursion-huginn-adapter": (dict(kv="recursion"), "concat_adapter", {}),
    "expert-shared-lora-mlp": (dict(kv="shared"), "anchor", dict(lora={"rank": 2, "targets": ["mlp"]})),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_skipping_equals_the_frozen_path(name):
    halting, topology, fields = CASES[name]
    assert_skipping_equals_frozen(halting, topology, **fields)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routing=st.sampled_from(["expert_choice", "token_choice"]), kv=st.sampled_from(["recursion", "shared"]),
       top_k=st.booleans(), topology=st.sampled_from(["anchor", "residual", "gated_residual", "base"]),
       window=st.sampled_from([None, 3, 6]), kv_heads=st.sampled_from([1, 2, 4]), padded=st.booleans())
def test_skipping_equals_the_frozen_path_over_the_configuration_space(routing, kv, top_k, topology, window, kv_heads,
                                                                      padded):
    halting = dict(routing=routing, kv=kv, selection="top_k" if top_k and routing == "expert_choice" else "threshold")
    mixer = {"kind": "attention"} if window is None else {"kind": "sliding_window", "window": window}
    assert_skipping_equals_frozen(halting, topology, padded=padded, mixer=mixer, n_kv_heads=kv_heads)


@pytest.mark.parametrize("halting", [dict(kv="recursion"), dict(kv="shared", routing="token_choice"),
                                     dict(kv="shared", auxiliary="router")],
                         ids=["expert-recursion", "token-shared", "expert-auxiliary-router-shared"])
def test_skipping_keeps_causality_and_decoding(halting):
    """The training forward (skipping) is strictly causal, and decoding (a skipping prefill
    under kv: shared, then one new position per row) gives the skipping full forward's logits."""
    m = build(halting, True)
    x = random_ids(2, 15)
    assert_strictly_causal(m.train(), x, (0, 6, 14), shift=7)
    assert_strictly_causal(m.eval(), x, (0, 6, 14), shift=7)
    assert min(rows_seen(m, lambda: m(x))) < 15
    assert_decodes_like_full_forward(m, random_ids(3, 13), [prefill_then_tokens(1, 13), prefill_then_tokens(6, 13),
                                                            [5, 9, 12, 13]], atol=2e-5)


def test_a_moe_core_skips_with_the_same_logits():
    """A mixture-of-experts FFN in the core: the skipping forward gives the frozen path's
    logits and LM loss; the MoE's balance loss counts the rows each step ran (gathered)."""
    x = random_ids(2, 15)
    moe = {"experts": 4, "top_k": 2, "hidden": 24}
    out, ref = (build(dict(kv="recursion"), skip, moe=moe).train()(x, targets=x) for skip in (True, False))
    torch.testing.assert_close(out.logits, ref.logits, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.lm_loss, ref.lm_loss)
    assert sorted(out.aux_losses) == sorted(ref.aux_losses) and torch.isfinite(out.aux_losses["moe_balance"])
    assert out.aux_losses["moe_balance"] != ref.aux_losses["moe_balance"]


def test_what_runs_every_position():
    """Skipping applies to a forward without a decoding cache and without attention maps, and
    to the prefill of an empty growing cache under kv: shared (later steps cache nothing);
    under kv: all (later steps read every position's keys) every position runs every step."""
    x = random_ids(2, 12)
    m = build(dict(kv="recursion"), True).eval()
    assert min(rows_seen(m, lambda: m(x))) < 12
    assert min(rows_seen(m, lambda: m(x, output_attentions=True))) == 12
    assert min(rows_seen(m, lambda: m(x, cache=LoopCache()))) == 12
    shared = build(dict(kv="shared"), True).eval()
    assert min(rows_seen(shared, lambda: shared(x, cache=LoopCache()))) < 12
    assert min(rows_seen(shared, lambda: shared(x, cache=LoopCache(full_loop=True)))) == 12
    cache = LoopCache()
    shared(x[:, :6], cache=cache)
    assert min(rows_seen(shared, lambda: shared(x[:, 6:], cache=cache))) == 6  # a chunk after cached positions
    plain = build(dict(kv="all"), True).eval()
    assert min(rows_seen(plain, lambda: plain(x))) == 12


def test_torch_compile_takes_the_frozen_path_in_one_graph():
    """The gathered length is data-dependent (a host read), so a compiled forward takes the
    frozen path: one graph for forward and backward, no break, and the skipping eager
    forward's logits and gradients, over inputs whose gathered lengths differ."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = build(dict(kv="shared"), True).train()
    compiled = torch.compile(lambda ids: m(ids, targets=ids), backend="aot_eager", fullgraph=True)
    params = [p for p in m.parameters() if p.requires_grad]
    lengths = set()
    for seed in range(3):
        x = random_ids(2, 12, seed=seed)
        lengths.add(tuple(rows_seen(m, lambda: m(x))))
        out, ref = compiled(x), m(x, targets=x)
        torch.testing.assert_close(out.logits, ref.logits, atol=2e-6, rtol=1e-5)
        grads = torch.autograd.grad(out.loss, params, allow_unused=True)
        for a, b in zip(grads, torch.autograd.grad(ref.loss, params, allow_unused=True)):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    assert len(lengths) > 1, "the inputs should gather different lengths"
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_gathered_rows_by_hand():
    running = torch.tensor([[True, False, True, True, False],
                            [False, False, True, False, False]])
    rows = GatheredRows.of(running)
    assert rows.index[0].tolist() == [0, 2, 3] and rows.index[1, 0].item() == 2
    assert len(set(rows.index[1].tolist())) == 3 and not running[1, rows.index[1, 1:]].any()
    assert rows.valid.tolist() == [[True, True, True], [True, False, False]]
    x = torch.arange(10.0).view(2, 5, 1)
    assert rows.gather(x)[0, :, 0].tolist() == [0.0, 2.0, 3.0]
    back = rows.scatter(x, rows.gather(x) + 100)
    assert back[0, :, 0].tolist() == [100.0, 1.0, 102.0, 103.0, 4.0]
    # row 0's queries (positions 0, 2, 3) over its gathered keys, window 2: causal by position
    mask = rows.mask(rows.index, rows.valid, window=2)[0, 0]
    assert mask.tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    # over all 5 positions' keys, position 1 not a valid key
    over_all = rows.mask(torch.arange(5)[None], torch.tensor([[True, False, True, True, True]] * 2), None)[0, 0]
    assert over_all.tolist() == [[True, False, False, False, False], [True, False, True, False, False],
                                 [True, False, True, True, False]]


def test_skip_must_be_a_boolean():
    with pytest.raises(ConfigError, match=r"model\.halting\.skip"):
        tiny_config("anchor", layout="1R3", halting={"kind": "mor", "depths": 3, "kv": "shared", "skip": "yes"})
