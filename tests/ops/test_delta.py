"""The delta-rule ops: chunkwise and recurrent forms against the plain recurrence (forward
and backward, odd lengths, initial states, every gate kind) and against
flash-linear-attention's own references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from looplm.ops.delta import chunk_delta_rule, delta_rule_step, naive_recurrent_delta_rule, recurrent_delta_rule

GATES = ["none", "scalar", "channel"]  # DeltaNet, GDN, KDA


def make_inputs(B, T, H, K, V, gate, dtype=torch.float64, seed=0, decay=1.0):
    """q, k (unit norm), v, beta in (0, 1), log_alpha (<= 0, scaled by ``decay``), S_0."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    shape = {"none": None, "scalar": (B, T, H), "channel": (B, T, H, K)}[gate]
    log_alpha = None if shape is None else decay * F.logsigmoid(2 + torch.randn(*shape, generator=g, dtype=dtype))
    h0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return q, k, v, beta, log_alpha, h0


def outputs_and_grads(fn, q, k, v, beta, log_alpha, h0, **kwargs):
    """(o, S_T, grads of a generic loss w.r.t. every input)."""
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v, beta, h0)]
    la = None if log_alpha is None else log_alpha.detach().clone().requires_grad_()
    o, S = fn(*inputs[:4], la, initial_state=inputs[4], output_final_state=True, **kwargs)
    weights = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
    loss = (o * weights).sum() + (S * S).sum()
    grads = torch.autograd.grad(loss, inputs + ([la] if la is not None else []))
    return o, S, grads


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T,chunk_size", [(1, 16), (17, 16), (37, 64), (131, 32)])
def test_chunk_equals_naive_forward_and_backward(gate, T, chunk_size):
    args = make_inputs(2, T, 3, 8, 5, gate)
    o_ref, S_ref, g_ref = outputs_and_grads(naive_recurrent_delta_rule, *args)
    o, S, g = outputs_and_grads(chunk_delta_rule, *args, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(S, S_ref)
    for got, want in zip(g, g_ref):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("gate", GATES)
def test_recurrent_equals_naive_and_steps_compose(gate):
    q, k, v, beta, log_alpha, h0 = make_inputs(2, 23, 2, 6, 4, gate)
    o_ref, S_ref, g_ref = outputs_and_grads(naive_recurrent_delta_rule, q, k, v, beta, log_alpha, h0)
    o, S, g = outputs_and_grads(recurrent_delta_rule, q, k, v, beta, log_alpha, h0)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(S, S_ref)
    for got, want in zip(g, g_ref):
        torch.testing.assert_close(got, want)
    state = h0
    for t in range(q.shape[1]):  # the decoding step, one position at a time
        o_t, state = delta_rule_step(
            q[:, t], k[:, t], v[:, t], beta[:, t], None if log_alpha is None else log_alpha[:, t], state, 6**-0.5
        )
        torch.testing.assert_close(o_t, o_ref[:, t])
    torch.testing.assert_close(state, S_ref)


@pytest.mark.parametrize("gate", GATES)
def test_float32_chunk_matches_float64_reference(gate):
    args = make_inputs(1, 75, 2, 16, 16, gate)
    o_ref, S_ref = naive_recurrent_delta_rule(*args[:5], initial_state=args[5], output_final_state=True)
    o, S = chunk_delta_rule(*(None if x is None else x.float() for x in args[:5]), initial_state=args[5].float(),
                            output_final_state=True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    torch.testing.assert_close(o, o_ref.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(S, S_ref.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_strong_decays_stay_finite_and_exact(gate):
    """Cumulative log decays of -1e3 inside one chunk: every exponent the chunk form
    forms is <= 0, so nothing overflows in float32."""
    args = make_inputs(1, 64, 2, 8, 4, gate, dtype=torch.float32, decay=40.0)
    o_ref, S_ref = naive_recurrent_delta_rule(*args[:5], initial_state=args[5], output_final_state=True)
    o, S, grads = outputs_and_grads(chunk_delta_rule, *args, chunk_size=64)
    assert all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("gate", GATES)
def test_gradcheck_float64(gate):
    q, k, v, beta, log_alpha, h0 = make_inputs(1, 19, 2, 3, 2, gate)  # two chunks of 16
    inputs = [x.requires_grad_() for x in (q, k, v, beta, h0)]
    inputs += [log_alpha.requires_grad_()] if log_alpha is not None else []

    def fn(q, k, v, beta, h0, log_alpha=None):
        o, S = chunk_delta_rule(q, k, v, beta, log_alpha, initial_state=h0, output_final_state=True, chunk_size=16)
        return o, S

    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


def test_padding_positions_leave_the_state_unchanged():
    """beta = 0 and log alpha = 0 at a position: the state skips it (how layers pad)."""
    q, k, v, beta, log_alpha, h0 = make_inputs(1, 9, 2, 4, 3, "channel")
    beta[:, :4], log_alpha[:, :4] = 0, 0
    _, S = chunk_delta_rule(q, k, v, beta, log_alpha, initial_state=h0, output_final_state=True)
    _, S_tail = chunk_delta_rule(q[:, 4:], k[:, 4:], v[:, 4:], beta[:, 4:], log_alpha[:, 4:], initial_state=h0,
                                 output_final_state=True)
    torch.testing.assert_close(S, S_tail)


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2), T=st.integers(1, 70), H=st.integers(1, 3), K=st.integers(1, 9), V=st.integers(1, 9),
    gate=st.sampled_from(GATES), chunk_size=st.sampled_from([16, 32, 64]), with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunk_equals_naive_property(B, T, H, K, V, gate, chunk_size, with_state, seed):
    q, k, v, beta, log_alpha, h0 = make_inputs(B, T, H, K, V, gate, seed=seed)
    h0 = h0 if with_state else None
    o_ref, S_ref = naive_recurrent_delta_rule(q, k, v, beta, log_alpha, initial_state=h0, output_final_state=True)
    o, S = chunk_delta_rule(q, k, v, beta, log_alpha, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(S, S_ref)


def test_input_errors():
    q, k, v, beta, log_alpha, h0 = make_inputs(1, 4, 2, 3, 2, "scalar")
    with pytest.raises(ValueError, match="power of two"):
        chunk_delta_rule(q, k, v, beta, log_alpha, chunk_size=48)
    with pytest.raises(ValueError, match="log_alpha must be"):
        chunk_delta_rule(q, k, v, beta, log_alpha[..., None].expand(1, 4, 2, 5))
    with pytest.raises(ValueError, match="initial_state must be"):
        naive_recurrent_delta_rule(q, k, v, beta, initial_state=h0[:, :1])
