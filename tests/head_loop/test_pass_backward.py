"""A head pass's hand-written pieces (issue 25): the rotation of q and k with its backward
written as the rotation by -θ, and the residual added by the W_O product, give the logits
and gradients of the pass written with autograd's own chain (kept here as the reference)
on every head-loop configuration: MHA (arranged: narrow views; unarranged: gathers), GQA
with output gate and biases, sliding window, RMSNorm without biases, partial rotary,
fading heads, a loop-level hybrid, and bf16 autocast."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from looplm import LoopLM
from looplm.head_loop.block import HeadLoopBlock
from looplm.model_config import ModelConfig
from looplm.modules.rotary import apply_rotary_heads_last
from tests.head_loop.test_arrange import GROWN
from tests.head_loop.test_arrange import VARIANTS as ARRANGE_VARIANTS

#: test_arrange's configurations (MHA, RMSNorm without biases, GQA with gate and biases,
#: GQA of 4 groups, sliding window, loop-level hybrid) and partial / no rotary; grown as
#: there (GROWN: block 1 mid-fade, every head looping, block 2 after the drop)
VARIANTS = {**ARRANGE_VARIANTS, "mha_partial_rotary": {"rotary_pct": 0.5}, "mha_no_rotary": {"rotary_pct": 0.0}}


def _batched_linear(x, weight, bias):
    """x [N, d] through k stacked projections weight [k, r, d] (+ bias [k, r]): [k, N, r]."""
    rows = x.to(weight.dtype).expand(weight.shape[0], *x.shape)
    if bias is None:
        return torch.bmm(rows, weight.transpose(1, 2))
    return torch.baddbmm(bias[:, None], rows, weight.transpose(1, 2))


def _stacked(weight, bias, k):
    return weight.view(k, -1, weight.shape[-1]), None if bias is None else bias.view(k, -1)


def reference_head_subset_attention(attn, x, ctx, loop, weights, state):
    """The head pass before issue 25's hand-written pieces: q, k, v (k, v under GQA) from
    one batched product over copies of x, autograd's chain through the split, the rotation
    and the unbind, and the residual added after W_O."""
    B, T, d = x.shape
    D, n = attn.head_dim, len(loop.slots)
    rows = x.reshape(B * T, d)
    m = (weights.qkv.shape[0] // D - n) // 2
    if m == n:  # MHA
        qk, v = _batched_linear(rows, *_stacked(weights.qkv, weights.qkv_bias, 3)).view(3, B, T, n, D).split([2, 1])
        q, k = (t.transpose(1, 2) for t in apply_rotary_heads_last(qk, *ctx.rope).unbind(0))
        v = v.squeeze(0).transpose(1, 2)
    else:  # q, then k and v: the GQA pass's two products before they were one
        bias = weights.qkv_bias
        q = F.linear(x, weights.qkv[: n * D], None if bias is None else bias[: n * D]).view(B, T, n, D)
        kv_bias = None if bias is None else bias[n * D:]
        k, v = _batched_linear(rows, *_stacked(weights.qkv[n * D:], kv_bias, 2)).view(2, B, T, m, D).unbind(0)
        q, k, v = (t.transpose(1, 2) for t in (apply_rotary_heads_last(q, *ctx.rope),
                                                 apply_rotary_heads_last(k, *ctx.rope), v))
    kv_index = loop.pass_kv[:n] if loop.kv_mapped else None
    y, new_state = attn.attend_rotated(q, k, v, ctx, state, kv_index)
    if weights.gate is not None:
        y = y * torch.sigmoid(F.linear(x, weights.gate, weights.gate_bias))
    if loop.scaled:
        y = y * loop.pass_scale[: n * D].to(y.dtype)
    return F.linear(y, weights.out), new_state


class ReferenceHeadLoopBlock(HeadLoopBlock):
    def _extra_pass(self, x, ctx, mixer, state, weights):
        update, state = reference_head_subset_attention(mixer, self.attn_norm(x), ctx, self.head_loop, weights, state)
        return x + update, state


def _models(variant: str, arranged: bool) -> tuple[LoopLM, LoopLM]:
    kw = {"n_heads": 4, "layout": "1+2R2+1", **VARIANTS[variant]}
    torch.manual_seed(0)
    model = LoopLM(ModelConfig(vocab_size=40, d_model=32, head_loop={"kind": "heads"}, **kw))
    n = model.cfg.n_heads
    for layer, (depth, first, rest) in GROWN.items():
        block = model.blocks()[layer]
        block.head_loop.set(depth, [1.0 if h in first else rest for h in range(n)])
        if arranged:
            block.arrange_heads(first)
    reference = copy.deepcopy(model)
    for layer in GROWN:
        reference.blocks()[layer].__class__ = ReferenceHeadLoopBlock
    return model, reference


def _logits_and_grads(model: LoopLM, ids: torch.Tensor, autocast: bool):
    model.zero_grad(set_to_none=True)
    guard = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with guard:
        out = model(ids[:, :-1], ids[:, 1:])
    out.loss.backward()
    return out.logits.float(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arranged", [True, False], ids=["arranged", "gathered"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_head_passes_equal_autograds_chain(variant, arranged):
    model, reference = _models(variant, arranged)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    got_logits, got = _logits_and_grads(model, ids, autocast=False)
    want_logits, want = _logits_and_grads(reference, ids, autocast=False)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-6, atol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", ["mha", "gqa_gate_bias"])
def test_head_passes_equal_autograds_chain_under_bf16_autocast(variant):
    """Under autocast the rotated q, k are float32 and v bf16 (the tables are float32):
    the same logits, and gradients in each parameter's dtype to bf16 rounding (at this
    size q's and k's gradients are too small to tell a wrong rotation: the unit test
    below does, in bf16 too)."""
    model, reference = _models(variant, arranged=True)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(2))
    got_logits, got = _logits_and_grads(model, ids, autocast=True)
    want_logits, want = _logits_and_grads(reference, ids, autocast=True)
    assert torch.equal(got_logits, want_logits)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        torch.testing.assert_close(got[name], want[name], rtol=2e-2, atol=2e-3, msg=name)


def test_grown_model_traces_as_one_graph():
    """Dynamo traces the hand-written pieces without a graph break (train.compile), and
    the compiled loss and gradients equal eager."""
    model, _ = _models("mha", arranged=True)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(3))
    params = list(model.parameters())

    def loss(inputs, targets):
        return model(inputs, targets).loss

    want = loss(ids[:, :-1], ids[:, 1:])
    got = torch.compile(loss, backend="aot_eager", fullgraph=True)(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("variant", ["mha", "gqa_gate_bias", "gqa_4_groups"])
def test_a_pass_projects_and_rotates_q_k_v_at_once(variant):
    """Every arranged pass, grouped-query ones included, runs its q, k, v rows as one GEMM
    and splits and rotates them in one function (one concatenation in its backward), where
    the reference's chain takes two products (GQA) and autograd's slices: fewer operators
    for the same gradients (checked above)."""
    from looplm.accounting.dispatch import count_dispatch

    model, reference = _models(variant, arranged=True)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(3))

    def counts(m):
        def step():
            m(ids[:, :-1], ids[:, 1:]).loss.backward()

        step()
        m.zero_grad(set_to_none=True)
        return count_dispatch(step)[0]

    got, want = counts(model), counts(reference)
    assert got.syncs == 0 and got.ops < want.ops, (got.ops, want.ops)
