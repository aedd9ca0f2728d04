"""Mixture-of-Recursions (looplm.halting.mor): the gated update and selection against hand
computations, top-k capacity, the auxiliary BCE and balancing losses, causality of each
selection form, decoding, realised compute and the FLOP rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looplm import LoopLM
from looplm.accounting.cost import Call, Cost, module_cost
from looplm.config_base import ConfigError
from looplm.halting import HaltingConfig, MoRHalting
from looplm.topology.base import LoopState
from tests.conftest import random_ids, tiny_config
from tests.invariants import assert_decodes_like_full_forward, assert_strictly_causal, prefill_then_tokens

D = 8


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def mor(**fields) -> dict:
    return {"kind": "mor", "depths": 3, **fields}


def model(halting: dict, layout: str = "1+1R3+1", router_std: float = 1.0) -> LoopLM:
    """A tiny MoR model whose routers have O(1) weights and zero biases, so positions leave
    at different steps."""
    m = LoopLM(tiny_config("anchor", layout=layout, halting=halting))
    with torch.no_grad():
        for name, p in m.halting.named_parameters():
            p.normal_(0.0, router_std / D ** 0.5) if name.endswith("weight") else p.zero_()
    return m


def rule(**fields) -> MoRHalting:
    return HaltingConfig.from_dict(mor(**fields)).build(D)


def forward_recording(m: LoopLM, modules, ids: torch.Tensor):
    """m(ids) and the outputs of ``modules`` during it (a last dimension of 1 squeezed), in call order."""
    seen = []
    hooks = [mod.register_forward_hook(lambda mod, args, out: seen.append(out.squeeze(-1).detach())) for mod in modules]
    try:
        return m(ids), seen
    finally:
        for hook in hooks:
            hook.remove()


def test_expert_choice_routes_then_gates_the_next_step():
    """After step 0 the router of step 1, s = wᵀy + b on the state step 1 reads, keeps the
    positions with σ(s) > 0.5; step 1 gives them h + α·σ(s)·(h' − h) (Eq. 2 on the step's
    change) and leaves the others' h and carrier exactly as they were."""
    r = rule(alpha=0.5).eval()
    y = torch.randn(2, 5, D)
    halt = r.begin(y, torch.ones(2, 5, dtype=torch.bool))
    old = LoopState(h=y, carrier={"h0": torch.randn(2, 5, D)})
    r.fold(halt, old, old, 0)  # step 0: every position, no gate
    r.observe(halt, y, 0, False, None, None)
    s = y @ r.routers[0].score.weight[0] + r.routers[0].score.bias[0]
    chosen = s > 0
    assert chosen.any() and (~chosen).any()
    assert torch.equal(halt.running, chosen) and torch.equal(halt.steps, torch.ones(2, 5, dtype=torch.long))
    new = LoopState(h=torch.randn(2, 5, D), carrier={"h0": torch.randn(2, 5, D)})
    out = r.fold(halt, old, new, 1)
    expected = y + 0.5 * torch.sigmoid(s)[..., None] * (new.h - y)
    torch.testing.assert_close(out.h[chosen], expected[chosen])
    assert torch.equal(out.h[~chosen], y[~chosen])
    assert torch.equal(out.carrier["h0"][~chosen], old.carrier["h0"][~chosen])
    assert torch.equal(out.carrier["h0"][chosen], new.carrier["h0"][chosen])


def test_a_position_that_left_never_returns():
    r = rule().eval()
    halt = r.begin(torch.randn(1, 6, D), torch.ones(1, 6, dtype=torch.bool))
    taken = []
    for t in range(3):
        taken.append(halt.running.clone())
        r.observe(halt, torch.randn(1, 6, D), t, t == 2, None, None)
    assert taken[0].all()
    for before, after in zip(taken, taken[1:]):
        assert not (after & ~before).any()


def test_top_k_training_keeps_the_capacity_of_each_step():
    """selection=top_k in training: step r keeps k_r = ⌊β_r·T⌋ positions per row (hierarchical
    (N − r)/N by default: 12, 8, 4 of 12), each among those that took step r − 1."""
    m = model(mor(selection="top_k")).train()
    out = m(random_ids(2, 12))
    selected = out.record["mor_selected"]
    assert [s.sum(dim=1).tolist() for s in selected] == [[12, 12], [8, 8], [4, 4]]
    assert (out.halt_steps.sum(dim=1) == 24).all()
    m2 = model(mor(selection="top_k", capacity=[0.5, 0.25])).train()
    assert [s.sum(dim=1).tolist() for s in m2(random_ids(2, 12)).record["mor_selected"]] == [[12, 12], [6, 6], [3, 3]]


def test_top_k_training_is_not_causal_and_its_inference_form_is():
    """Why selection=top_k stays out of the invariant sweep: in training a later token's
    router score moves an earlier position in or out of the top-k, so its logits change.
    At inference it selects by σ(s) > 0.5 per position: causal and decoded exactly."""
    m = model(mor(selection="top_k")).train()
    x = random_ids(2, 15)
    base = m(x).logits
    leaked = False
    for shift in range(1, 8):
        y = x.clone()
        y[:, 14] = (y[:, 14] + shift) % 61
        leaked |= bool((m(y).logits[:, :14] - base[:, :14]).abs().max() > 1e-4)
    assert leaked, "top-k over the sequence should let the last token move earlier positions"
    m.eval()
    assert_strictly_causal(m, x, (0, 6, 14), shift=7)
    assert_decodes_like_full_forward(m, random_ids(3, 13), [prefill_then_tokens(2, 13)], atol=2e-5)


@pytest.mark.parametrize("halting", [mor(), mor(routing="token_choice")], ids=["expert", "token"])
def test_threshold_and_token_choice_are_causal_in_training_too(halting):
    """The causal forms run one rule in training and inference: the training forward is
    strictly causal as well (the auxiliary losses may read the whole sequence; the logits
    never do)."""
    m = model(halting).train()
    assert_strictly_causal(m, random_ids(2, 15), (0, 6, 14), shift=7)


def test_auxiliary_bce_by_hand():
    """mor_router = w · mean over (step, position still running) of BCE(s, 1[top-k of s])."""
    m = model(mor(aux_loss_weight=0.5)).train()
    out, scores = forward_recording(m, [r.score for r in m.halting.routers], random_ids(2, 12))
    eligible = torch.ones(2, 12, dtype=torch.bool)
    total, count = 0.0, 0
    for t, s in enumerate(scores, start=1):  # the routers of steps 1 and 2
        k = int(m.halting.capacity[t] * 12)
        target = torch.zeros(2, 12, dtype=torch.bool)
        target.scatter_(1, s.masked_fill(~eligible, float("-inf")).topk(k, dim=1).indices, True)
        target &= eligible
        bce = F.binary_cross_entropy_with_logits(s, target.float(), reduction="none")
        total, count = total + (bce * eligible).sum(), count + eligible.sum()
        eligible = eligible & (s > 0)
    torch.testing.assert_close(out.aux_losses["mor_router"], 0.5 * total / count)
    assert "mor_router" not in m.eval()(random_ids(2, 12)).aux_losses  # training only, as the reference


def test_token_choice_depth_and_balancing_loss_by_hand():
    """depth = argmax softmax(W h¹ + b) + 1 on the state after step 0; balancing loss
    w·N·Σ_i f_i P_i over real positions."""
    m = model(mor(routing="token_choice", balance_weight=0.3), layout="1R3").train()
    out, logits = forward_recording(m, [m.halting.router], random_ids(2, 12))
    probs = torch.softmax(logits[0], dim=-1)
    depth = probs.argmax(dim=-1)
    assert torch.equal(out.halt_steps, depth + 1)
    assert len(depth.unique()) > 1
    share = F.one_hot(depth, 3).float().mean(dim=(0, 1))
    torch.testing.assert_close(out.aux_losses["mor_balance"], 0.3 * 3 * (share * probs.mean(dim=(0, 1))).sum())


@pytest.mark.parametrize("halting", [mor(aux_loss_weight=0.0), mor(routing="token_choice", balance_weight=0.0)],
                         ids=["expert", "token"])
def test_the_lm_loss_trains_the_routers_through_the_gate(halting):
    m = model(halting).train()
    x = random_ids(2, 12)
    m(x, targets=x).loss.backward()
    grads = [p.grad for p in m.halting.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0


def test_realised_block_passes_follow_each_positions_depth():
    m = model(mor()).eval()
    out = m(random_ids(2, 12))
    assert len(out.halt_steps.unique()) > 1
    assert torch.equal(out.block_passes, 2 + out.halt_steps)  # prelude + core·steps + coda


def test_flop_rule_by_hand():
    """Expert choice, per routed step: router d -> 1 (d MACs + a bias) and the gated update
    (3d); token choice, once: router d -> N (N·d MACs + N biases) and N − 1 gated updates.
    The auxiliary router (d -> 1) is a step of its own, on the detached state: its backward
    is a weight gradient only."""
    call = Call(2, 5, 5, width=D)
    assert rule().flop_cost(call) == Cost(mac=10 * D, bias=10, state=30 * D)
    assert rule(routing="token_choice").flop_cost(call) == Cost(mac=10 * 3 * D, bias=30, state=2 * 30 * D)
    aux = rule(auxiliary="router")
    assert aux.flop_cost(call) == rule().flop_cost(call)
    steps = aux.step_calls(0, call, None, targets=False)
    assert [(s.name, s.input_grad) for s in steps] == [("halting.0", True), ("halting.aux.0", False)]
    assert module_cost(steps[1].module, call) == Cost(mac=10 * D, bias=10)


def test_parameter_count_matches_the_module():
    for fields in ({}, {"routing": "token_choice"}, {"auxiliary": "router"}):
        cfg = HaltingConfig.from_dict(mor(**fields))
        assert cfg.parameter_count(D) == sum(p.numel() for p in cfg.build(D).parameters())


@pytest.mark.parametrize("fields,field", [
    ({"routing": "token_choice", "selection": "top_k"}, "model.halting.selection"),
    ({"routing": "sideways"}, "model.halting.routing"),
    ({"capacity": [1.0]}, "model.halting.capacity"),
    ({"capacity": [0.5, 0.0]}, "model.halting.capacity"),
    ({"routing": "token_choice", "capacity": [0.5, 0.5]}, "model.halting.capacity"),
    ({"kv": "sometimes"}, "model.halting.kv"),
    ({"kv": "first"}, "model.halting.kv"),
    ({"auxiliary": "router", "aux_loss_weight": 0.0}, "model.halting.auxiliary"),
    ({"auxiliary": "router", "routing": "token_choice"}, "model.halting.auxiliary"),
    ({"depths": 1}, "model.halting.depths"),
    ({"alpha": 0.0}, "model.halting.alpha"),
])
def test_bad_fields_are_refused_by_name(fields, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        HaltingConfig.from_dict(mor(**fields))


def test_depths_must_match_the_loop():
    with pytest.raises(ConfigError, match=r"model\.halting\.depths.*1R4"):
        tiny_config("anchor", layout="1R4", halting=mor())


#: operators and host syncs of one training forward + backward of the 1+1R3+1 model below
#: (measured: fixed depth 272 ops / 0 syncs; MoR adds after each step but the last its router,
#: then the gated update and, in training, the auxiliary loss's top-k target; the syncs are the
#: loop's "all left?" check after steps 0 and 1), and of generating 4 tokens after a 4-token prompt
#: (generate's two whole-tensor reads, Tensor.tolist, included); under kv: shared the later steps'
#: one query projection replaces the fused qkv and its split, decoding needs no catch-up, and the
#: later steps run on the gathered positions taking them (skip): one host sync each for the
#: gathered length (its sort, gathers and scatters launch no more operators than the frozen
#: path's keep-masks did: 385 -> 380 and 370 -> 365), in training and in the prompt's prefill
#: (decoding 597 -> 564 and 617 -> 584 operators, 15 -> 17 syncs)
DISPATCH_BUDGET = {("expert_choice", "all"): (389, 2, 652, 24), ("token_choice", "all"): (374, 2, 672, 24),
                   ("expert_choice", "shared"): (380, 4, 564, 17), ("token_choice", "shared"): (365, 4, 584, 17)}


@pytest.mark.parametrize("routing,kv", sorted(DISPATCH_BUDGET))
def test_dispatch_counts_stay_within_budget(routing, kv):
    from looplm.accounting.dispatch import count_dispatch

    m = LoopLM(tiny_config("base", layout="1+1R3+1", halting=mor(routing=routing, kv=kv))).train()
    x = random_ids(2, 16)

    def train_step():
        out = m(x, targets=x)
        out.loss.backward()

    train, _ = count_dispatch(train_step)
    m.eval()
    decode, _ = count_dispatch(lambda: m.generate(x[:, :4], max_new_tokens=4, do_sample=False))
    ops, syncs, decode_ops, decode_syncs = DISPATCH_BUDGET[(routing, kv)]
    assert train.ops <= ops and train.syncs <= syncs, f"training: {train}; by op {dict(train.by_op)}"
    assert decode.ops <= decode_ops and decode.syncs <= decode_syncs, f"decoding: {decode}; by op {dict(decode.by_op)}"


def test_recursion_wise_kv_hides_the_keys_of_positions_not_taking_the_step():
    """kv: recursion (the paper's recursion-wise KV caching): at step t >= 1 a query sees no
    key of a position that left before t (except itself); step 0 sees every position."""
    m = model(mor(kv="recursion"), layout="1R3").eval()
    out = m(random_ids(1, 12), output_attentions=True)
    selected = out.record["mor_selected"]  # who took step t
    assert not selected[1].all() and selected[1].any()
    for t in (1, 2):
        probs = out.attentions[("core.0", t)][0]  # [H, T, S]
        hidden = ~selected[t][0]
        off_diagonal = ~torch.eye(12, dtype=torch.bool)
        seen = probs.sum(dim=0)[:, hidden] * off_diagonal[:, hidden]
        assert torch.equal(seen[selected[t][0]], torch.zeros_like(seen[selected[t][0]]))
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    assert (out.attentions[("core.0", 0)][0].sum(dim=0)[causal] > 0).all()


@pytest.mark.parametrize("halting", [mor(kv="recursion"), mor(kv="recursion", routing="token_choice")],
                         ids=["expert", "token"])
def test_recursion_wise_kv_is_causal_and_decodes_like_the_forward(halting):
    """The growing cache (depths kept with the frozen states) gives the full forward's
    logits, prefill + tokens and chunked (the full-loop and static caches: below, and in the
    invariant sweep of tests/conftest.py:all_configs)."""
    m = model(halting, layout="1+1R3+1").eval()
    x = random_ids(2, 15)
    plain = model({**halting, "kv": "all"}, layout="1+1R3+1").eval()
    plain.load_state_dict(m.state_dict())
    assert (m(x).logits - plain(x).logits).abs().max() > 1e-4  # the mask changes something
    assert_strictly_causal(m, x, (0, 6, 14), shift=7)
    assert_strictly_causal(m.train(), x, (0, 6, 14), shift=7)
    m.eval()
    assert_decodes_like_full_forward(m, random_ids(3, 13), [prefill_then_tokens(1, 13), prefill_then_tokens(6, 13),
                                                            [5, 9, 12, 13]], atol=2e-5)


@pytest.mark.parametrize("halting", [mor(kv="recursion"), mor(kv="recursion", routing="token_choice")],
                         ids=["expert", "token"])
def test_recursion_wise_kv_on_full_loop_and_static_caches(halting):
    """A full-loop cache (every step run for every position) keeps each position's depth in
    ``cache.depth``; so does a static cache, written in place at each new position's row:
    both give the full forward's logits, and so do the compiled decoding step, a crop and a
    beam reorder."""
    from looplm import LoopCache

    m = model(halting, layout="1+1R3+1").eval()
    x = random_ids(2, 12)
    full = m(x).logits
    assert len(m(x).halt_steps.unique()) > 1
    cache = LoopCache(full_loop=True)
    pieces = [m(x[:, :5], cache=cache).logits] + [m(x[:, i:i + 1], cache=cache).logits for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=2e-5, rtol=1e-5)
    assert cache.depth.shape == (2, 12) and torch.equal(cache.depth, m(x).halt_steps)
    cache = LoopCache(full_loop=True)
    m(x[:, :5], cache=cache)
    static = cache.static(12)
    rows = [m(x[:, i:i + 1], cache=static).logits for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(rows, dim=1), full[:, 5:], atol=2e-5, rtol=1e-5)
    assert torch.equal(static.depth, m(x).halt_steps)
    static.crop(8)  # rewind and decode again: the same logits
    torch.testing.assert_close(m(x[:, 8:9], cache=static).logits, full[:, 8:9], atol=2e-5, rtol=1e-5)
    static.select_batch(torch.tensor([1, 0]))  # a beam reorder swaps the rows' depths too
    torch.testing.assert_close(m(x.flip(0)[:, 9:10], cache=static).logits, full.flip(0)[:, 9:10], atol=2e-5,
                               rtol=1e-5)
    from torch._dynamo.utils import counters

    eager = m.generate(x[:, :5], max_new_tokens=6, do_sample=False, compile=None)
    torch._dynamo.reset()
    counters.clear()
    compiled = m.generate(x[:, :5], max_new_tokens=6, do_sample=False, compile={"backend": "eager"})
    assert torch.equal(eager.sequences, compiled.sequences)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])


def test_recursion_wise_kv_refuses_what_cannot_serve_it():
    with pytest.raises(ConfigError, match=r"model\.halting\.kv.*gated_deltanet"):
        tiny_config("anchor", layout="1R3", mixer={"kind": "gated_deltanet"}, halting=mor(kv="recursion"))


#: MoR across the other loop axes: topologies, step signal, loop-input norm, two streams,
#: windowed attention under recursion-wise KV, padding of the batch
COMBINATIONS = {
    "expert-residual-steps": (dict(topology="residual", step_embeddings=True), mor()),
    "expert-gated-kv": (dict(topology="gated_residual", mixer={"kind": "sliding_window", "window": 4}),
                        mor(kv="recursion")),
    "token-static-combination": (dict(topology="static_combination"), mor(routing="token_choice")),
    "token-anchor-embedding-kv": (dict(topology="anchor_embedding", loop_input_norm=True),
                                  mor(routing="token_choice", kv="recursion")),
    # the solution stream starts from Y⁰ = 0 and moves little in one step: larger router weights
    "expert-two-streams": (dict(topology="base", streams={"kind": "two", "outer": 1, "inner": 1, "init": "zeros"}),
                           mor(), 3.0),
    "expert-capacity-alpha": (dict(topology="anchor", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2),
                              mor(capacity=[0.5, 0.25], alpha=0.7)),
    "expert-auxiliary-router": (dict(topology="residual"), mor(auxiliary="router")),
    "expert-shared-kv-window": (dict(topology="gated_residual", mixer={"kind": "sliding_window", "window": 4}),
                                mor(kv="shared")),
    "token-shared-kv-gqa-gate": (dict(topology="residual", norm="rmsnorm", bias=False, n_kv_heads=2,
                                      mixer={"kind": "attention", "output_gate": True}),
                                 mor(routing="token_choice", kv="shared")),
}


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_invariants_across_the_loop_axes(name):
    fields, halting, *std = COMBINATIONS[name]
    fields = dict(fields)
    m = LoopLM(tiny_config(fields.pop("topology"), layout="1+1R3+1", halting=halting, **fields))
    with torch.no_grad():
        for pname, p in m.halting.named_parameters():
            p.normal_(0.0, std[0] if std else 1.0 / D ** 0.5) if pname.endswith("weight") else p.zero_()
    x = random_ids(2, 15)
    assert len(m.eval()(x).halt_steps.unique()) > 1, "positions should leave at different steps"
    assert_strictly_causal(m, x, (0, 6, 14), shift=7)
    assert_strictly_causal(m.train(), x, (0, 6, 14), shift=7)
    m.eval()
    assert_decodes_like_full_forward(m, random_ids(3, 13), [prefill_then_tokens(1, 13), [5, 9, 12, 13]], atol=2e-5)
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[0, :4] = 0  # a left-padded row gives its unpadded logits
    ids = random_ids(3, 13)
    padded = m(ids, attention_mask=mask).logits[0, 4:]
    torch.testing.assert_close(padded, m(ids[:1, 4:]).logits[0], atol=2e-5, rtol=1e-5)


def test_the_auxiliary_router_selects_and_learns_the_top_k_on_detached_states():
    """auxiliary: router (§2.2.1's auxiliary router): a second router per step, on the
    detached state, chooses by σ > 0.5 and takes the BCE toward the main router's top-k;
    the main router gates. The BCE reaches the auxiliary router's weights and no others."""
    m = model(mor(auxiliary="router", aux_loss_weight=1.0)).train()
    out, chooser = forward_recording(m, [r.chooser for r in m.halting.routers], random_ids(2, 12))
    assert torch.equal(out.record["mor_selected"][1], chooser[0] > 0)
    out.aux_losses["mor_router"].backward()
    choosers = [p for n, p in m.named_parameters() if ".chooser." in n]
    assert len(choosers) == 4 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in choosers)
    others = [p for n, p in m.named_parameters() if ".chooser." not in n]
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in others)


# ------------------------------------------------------------------ kv: shared (recursive KV sharing)


def _core_block_calls(m: LoopLM, x: torch.Tensor):
    """m(x) and, per call of core block 0 in step order, its input, context and output."""
    calls = []
    hook = m.core[0][0].register_forward_hook(lambda mod, args, out: calls.append((args[0], args[1], out[0])))
    try:
        return m(x), calls
    finally:
        hook.remove()


def _block_over_first_step_kv(block, x_first: torch.Tensor, x: torch.Tensor, ctx) -> torch.Tensor:
    """Block output at a later step by hand (§2.2.2): queries from x, keys and values the
    block's attention projects from the first step's input x_first, causal SDPA, W_O, FFN."""
    from looplm.modules.rotary import apply_rotary_heads_last

    a = block.attn
    H, Hkv, D = a.n_heads, a.n_kv_heads, a.head_dim
    B, T, _ = x.shape
    first = a.qkv(block.attn_norm(x_first)).view(B, T, H + 2 * Hkv, D)
    k = apply_rotary_heads_last(first[:, :, H:H + Hkv], *ctx.rope).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    v = first[:, :, H + Hkv:].transpose(1, 2).repeat_interleave(H // Hkv, 1)
    q = apply_rotary_heads_last(a.qkv(block.attn_norm(x)).view(B, T, H + 2 * Hkv, D)[:, :, :H], *ctx.rope)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True).transpose(1, 2).reshape(B, T, H * D)
    y = x + a.o_proj(y)
    return y + block.ffn(block.ffn_norm(y), ctx)


@pytest.mark.parametrize("routing", ["expert_choice", "token_choice"])
def test_shared_kv_later_steps_attend_over_the_first_steps_keys_and_values(routing):
    """kv: shared: core block 0 at steps 1 and 2 equals the hand computation with queries of
    its own input and keys/values of its step-0 input (grouped heads, biases); under kv: all
    the same hand computation does not hold (the check can fail)."""
    fields = dict(layout="1+1R3+1", n_kv_heads=2)
    shared = LoopLM(tiny_config("anchor", halting=mor(kv="shared", routing=routing), **fields)).eval()
    plain = LoopLM(tiny_config("anchor", halting=mor(routing=routing), **fields)).eval()
    plain.load_state_dict(shared.state_dict())
    x = random_ids(2, 11)
    for m, reuses in ((shared, True), (plain, False)):
        with torch.no_grad():
            _, calls = _core_block_calls(m, x)
        assert len(calls) == 3
        for x_t, ctx, out in calls[1:]:
            expected = _block_over_first_step_kv(m.core[0][0], calls[0][0], x_t, ctx)
            if reuses:
                torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
            else:
                assert (out - expected).abs().max() > 1e-3


def test_shared_kv_caches_the_first_steps_entries_alone():
    """Decoding keeps core entries of step 0 only (the later steps read them), needs no
    catch-up, and gives the full forward's logits."""
    from looplm import LoopCache

    m = model(mor(kv="shared")).eval()
    x = random_ids(2, 12)
    cache = LoopCache()
    m(x[:, :7], cache=cache)
    out = m(x[:, 7:8], cache=cache)
    assert sorted(cache.states) == [("coda.0", 0), ("core.0", 0), ("prelude.0", 0)]
    assert int(out.catch_up_passes) == 0
    for end in range(9, 13):
        out = m(x[:, end - 1:end], cache=cache)
    torch.testing.assert_close(out.logits[:, -1], m(x).logits[:, -1], atol=2e-5, rtol=1e-5)
    full_loop = LoopCache(full_loop=True)
    m(x, cache=full_loop)
    assert sorted(full_loop.states) == sorted(cache.states)


def test_shared_kv_flops_match_the_flop_counter_and_the_hand_count():
    """With every position taking every step (the routers' starting bias), FlopCounterMode
    measures what count_flops says (convention torch); the later steps save exactly their K/V
    projections: 2 steps × core blocks × rows·d·2·H_kv·D MACs (2 FLOPs each)."""
    from torch.utils.flop_counter import FlopCounterMode

    from looplm.accounting import count_flops

    cfg = tiny_config("anchor", layout="1+2R3+1", n_kv_heads=2, halting=mor(kv="shared"))
    m = LoopLM(cfg).eval()
    B, T = 2, 10
    x = random_ids(B, T)
    with FlopCounterMode(display=False) as counter:
        out = m(x, output_attentions=True)
    assert torch.equal(out.halt_steps, torch.full((B, T), 3))
    assert sum(counter.get_flop_counts()["Global"].values()) == count_flops(m, T, batch=B, convention="torch").forward
    plain = count_flops(tiny_config("anchor", layout="1+2R3+1", n_kv_heads=2, halting=mor()), T, batch=B)
    shared = count_flops(cfg, T, batch=B)
    saved_mac = 2 * cfg.structure.core * B * T * cfg.d_model * 2 * cfg.n_kv_heads * cfg.head_dim
    assert plain.forward - shared.forward == 2 * saved_mac  # the default convention leaves biases out


def test_shared_kv_blocked_window_path_equals_the_explicit_one():
    """A long training sequence takes the blocked sliding-window path at step 0 and the later
    steps reuse it; the explicit (probability-recording) path gives the same logits."""
    m = LoopLM(tiny_config("anchor", layout="1R3", max_seq_len=160, mixer={"kind": "sliding_window", "window": 4},
                           halting=mor(kv="shared"))).train()
    x = random_ids(1, 140)
    torch.testing.assert_close(m(x).logits, m(x, output_attentions=True).logits, atol=2e-5, rtol=1e-5)


def test_shared_kv_gradients_survive_activation_checkpointing():
    """Recomputed regions do not keep the first step's keys again: same loss and gradients."""
    from looplm.train.activation_checkpointing import apply_activation_checkpointing

    x = random_ids(2, 12)
    grads = []
    for mode in ("none", "block", "iteration"):
        torch.manual_seed(0)
        m = model(mor(kv="shared")).train()
        apply_activation_checkpointing(m, mode)
        out = m(x, targets=x)
        out.loss.backward()
        grads.append((out.loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]))
    for loss, g in grads[1:]:
        torch.testing.assert_close(loss, grads[0][0], atol=0, rtol=0)
        assert len(g) == len(grads[0][1])
        for a, b in zip(g, grads[0][1]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("overrides,field", [
    (dict(mixer={"kind": "gated_deltanet"}), r"model\.halting\.kv.*gated_deltanet"),
    (dict(share_core=False), r"model\.share_core"),
    (dict(loop_mixers=[{"kind": "attention"}, {"kind": "sliding_window", "window": 4}, {"kind": "attention"}]),
     r"model\.loop_mixers"),
    (dict(streams={"kind": "two", "outer": 1, "inner": 1}), r"model\.streams\.kind"),
    (dict(lora={"rank": 2}), r"model\.lora\.targets"),
])
def test_shared_kv_refuses_cores_whose_steps_differ(overrides, field):
    with pytest.raises(ConfigError, match=field):
        tiny_config("base", layout="1R3", halting=mor(kv="shared"), **overrides)
    tiny_config("base", layout="1R3", halting=mor(kv="shared"), lora={"rank": 2, "targets": ["o_proj", "mlp"]})
