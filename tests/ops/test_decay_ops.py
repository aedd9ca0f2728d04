"""The diagonal-decay op: chunkwise and recurrent forms against the naive recurrence
(forward and backward, odd lengths, initial states, scalar / diagonal / no decay, strong
decays), a float64 gradient check, and flash-linear-attention's own references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import looplm.ops.decay.chunk as chunk_module
from looplm.ops.decay import chunk_decay, decay_step, naive_recurrent_decay, recurrent_decay

DECAYS = ["none", "scalar", "diagonal"]


def _inputs(B, T, H, K, V, decay, seed=0, dtype=torch.float32, state=True):
    """``decay``: none / scalar / diagonal, log α = logsigmoid(3·N(0, 1)) (from ≈ 0 to strongly
    negative, mixed along T: some sub-chunks decay mildly, some strongly); diagonal-mild,
    log α ∈ [-0.05, 0] (every chunk factored whole); diagonal-medium, log α ∈ [-1, -0.7]
    (chunks of 32 or more too strong to factor whole, every sub-chunk of 16 mild)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=g, dtype=dtype), torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    shape = (B, T, H) if decay == "scalar" else (B, T, H, K)
    u = torch.rand(*shape, generator=g, dtype=dtype)
    log_alpha = {
        "none": None,
        "scalar": F.logsigmoid(3 * torch.randn(*shape, generator=g, dtype=dtype)),
        "diagonal": F.logsigmoid(3 * torch.randn(*shape, generator=g, dtype=dtype)),
        "diagonal-mild": -0.05 * u,
        "diagonal-medium": -(0.7 + 0.3 * u),
    }[decay]
    s0 = torch.randn(B, H, K, V, generator=g, dtype=dtype) if state else None
    return q, k, v, log_alpha, s0


def _grads(fn, q, k, v, log_alpha, s0, seed=1):
    """Outputs and the gradients of a random linear function of (o, S_T) w.r.t. every input."""
    leaves = [x.clone().requires_grad_(True) if x is not None else None for x in (q, k, v, log_alpha, s0)]
    o, S = fn(*leaves[:4], None, leaves[4], True)
    g = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=g)).sum() + (S * torch.randn(S.shape, generator=g)).sum()
    inputs = [x for x in leaves if x is not None]
    return (o, S), torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("decay", [*DECAYS, "diagonal-mild", "diagonal-medium"])
@pytest.mark.parametrize("T,chunk_size", [(1, 64), (37, 16), (130, 64), (77, 32), (23, 7)])
@pytest.mark.parametrize("initial_state", [True, False])
def test_chunk_matches_naive_forward_and_backward(decay, T, chunk_size, initial_state):
    q, k, v, log_alpha, s0 = _inputs(2, T, 2, 8, 6, decay, seed=T, state=initial_state)

    def chunk(*args):
        return chunk_decay(*args, chunk_size=chunk_size)

    (o, S), grads = _grads(chunk, q, k, v, log_alpha, s0)
    (o_ref, S_ref), grads_ref = _grads(naive_recurrent_decay, q, k, v, log_alpha, s0)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S, S_ref, atol=2e-5, rtol=1e-4)
    for grad, ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("decay", ["scalar", "diagonal"])
def test_strong_decays_stay_finite_and_exact(decay):
    """log α down to -1000 per step: the cumulative decay inside a chunk underflows, its
    inverse would overflow; the chunk form never forms either, and keeps short-range
    decays exact however large the cumulative sum is."""
    q, k, v, _, s0 = _inputs(1, 100, 2, 16, 4, decay, seed=3)
    shape = (1, 100, 2) if decay == "scalar" else (1, 100, 2, 16)
    g = torch.Generator().manual_seed(4)
    strong = torch.rand(shape, generator=g) < 0.5
    log_alpha = torch.where(strong, -1000 * torch.rand(shape, generator=g), -0.05 * torch.rand(shape, generator=g))
    (o, S), grads = _grads(lambda *a: chunk_decay(*a, chunk_size=64), q, k, v, log_alpha, s0)
    (o_ref, S_ref), grads_ref = _grads(naive_recurrent_decay, q, k, v, log_alpha, s0)
    assert torch.isfinite(o).all() and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S, S_ref, atol=2e-5, rtol=1e-4)
    for grad, ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("decay", DECAYS)
def test_recurrent_matches_naive_and_steps_chain(decay):
    q, k, v, log_alpha, s0 = _inputs(2, 19, 3, 4, 5, decay, seed=5)
    o_ref, S_ref = naive_recurrent_decay(q, k, v, log_alpha, 0.3, s0, True)
    o, S = recurrent_decay(q, k, v, log_alpha, 0.3, s0, True)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(S, S_ref)
    state, steps = s0, []  # one position at a time, as in decoding
    for t in range(19):
        o_t, state = decay_step(q[:, t], k[:, t], v[:, t], None if log_alpha is None else log_alpha[:, t], state, 0.3)
        steps.append(o_t)
    torch.testing.assert_close(torch.stack(steps, 1), o_ref)
    torch.testing.assert_close(state, S_ref)


@pytest.mark.parametrize("decay", DECAYS)
def test_prefill_then_steps_equals_one_pass(decay):
    q, k, v, log_alpha, _ = _inputs(2, 50, 2, 8, 4, decay, seed=6, state=False)
    o_full, S_full = chunk_decay(q, k, v, log_alpha, None, None, True, chunk_size=16)
    cut = lambda x, a, b: None if x is None else x[:, a:b]  # noqa: E731
    o, S = chunk_decay(q[:, :21], k[:, :21], v[:, :21], cut(log_alpha, 0, 21), None, None, True, chunk_size=16)
    pieces = [o]
    for t in range(21, 50):
        o, S = recurrent_decay(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cut(log_alpha, t, t + 1), None, S, True)
        pieces.append(o)
    torch.testing.assert_close(torch.cat(pieces, 1), o_full, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S, S_full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "decay,safe_log_decay",
    [("none", 20.0), ("scalar", 20.0), ("diagonal-medium", 1e9), ("diagonal-medium", 5.0),
     ("diagonal-medium", 3.4), ("diagonal-medium", 0.1)],
    ids=["none", "scalar", "diagonal-chunks-factored", "diagonal-sub-chunks-factored", "diagonal-mixed",
         "diagonal-by-element"],
)
def test_gradcheck_float64(decay, safe_log_decay, monkeypatch):
    """T = 19 over chunks of 8 with sub-chunks of 4: three chunks, the last partial. With
    log α ∈ [-1, -0.7], a sub-chunk decays by e^-2.8 to e^-4 and a chunk by at least e^-5.6,
    so the threshold picks each path of the diagonal intra-chunk term (and a mix)."""
    monkeypatch.setattr(chunk_module, "SUB_CHUNK", 4)
    monkeypatch.setattr(chunk_module, "SAFE_LOG_DECAY", safe_log_decay)
    q, k, v, log_alpha, s0 = _inputs(1, 19, 1, 2, 2, decay, seed=7, dtype=torch.float64)
    inputs = [x.requires_grad_(True) for x in (q, k, v, s0, log_alpha) if x is not None]

    def fn(q, k, v, s0, *log_alpha):
        return chunk_decay(q, k, v, log_alpha[0] if log_alpha else None, 0.7, s0, True, chunk_size=8)

    assert torch.autograd.gradcheck(fn, tuple(inputs), fast_mode=True)
    o, S = fn(*inputs)
    o_ref, S_ref = naive_recurrent_decay(q, k, v, log_alpha, 0.7, s0, True)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(S, S_ref)


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2), T=st.integers(1, 40), H=st.integers(1, 2), K=st.integers(1, 5), V=st.integers(1, 4),
    chunk_size=st.sampled_from([1, 3, 8, 16, 32]), decay=st.sampled_from([*DECAYS, "diagonal-medium"]),
    initial_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunk_equals_naive_on_small_shapes(B, T, H, K, V, chunk_size, decay, initial_state, seed):
    q, k, v, log_alpha, s0 = _inputs(B, T, H, K, V, decay, seed=seed, state=initial_state)
    o, S = chunk_decay(q, k, v, log_alpha, None, s0, True, chunk_size=chunk_size)
    o_ref, S_ref = naive_recurrent_decay(q, k, v, log_alpha, None, s0, True)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S, S_ref, atol=2e-5, rtol=1e-4)


def test_half_precision_inputs_keep_a_float32_state():
    q, k, v, log_alpha, s0 = _inputs(1, 20, 2, 4, 4, "diagonal", seed=8)
    o, S = chunk_decay(q.bfloat16(), k.bfloat16(), v.bfloat16(), log_alpha, None, s0, True, chunk_size=8)
    o_ref, _ = naive_recurrent_decay(q.bfloat16(), k.bfloat16(), v.bfloat16(), log_alpha, None, s0, True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, atol=2e-2, rtol=2e-2)


def test_bad_shapes_are_refused():
    q, k, v, log_alpha, s0 = _inputs(1, 5, 2, 4, 3, "diagonal")
    with pytest.raises(ValueError, match="log_alpha must be"):
        chunk_decay(q, k, v, log_alpha[..., :2])
    with pytest.raises(ValueError, match="initial_state must be"):
        recurrent_decay(q, k, v, log_alpha, None, s0.transpose(-1, -2))
    with pytest.raises(ValueError, match="v must be"):
        naive_recurrent_decay(q, k, v[:, :4])
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_decay(q, k, v, chunk_size=0)


# ------------------------------------------------------------ flash-linear-attention's references
def test_matches_fla_naive_recurrent_gla():
    """fla.ops.gla: gk = log α per key channel, scale fixed at K^-1/2, state [B, H, K, V]."""
    pytest.importorskip("fla")
    from fla.ops.gla.naive import naive_recurrent_gla

    q, k, v, log_alpha, s0 = _inputs(2, 45, 2, 8, 6, "diagonal", seed=9)
    o_ref, S_ref = naive_recurrent_gla(q, k, v, log_alpha, initial_state=s0, output_final_state=True)
    o, S = chunk_decay(q, k, v, log_alpha, None, s0, True, chunk_size=32)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S, S_ref, atol=2e-5, rtol=1e-4)


def test_matches_fla_simple_gla_references():
    """fla.ops.simple_gla: g = log α [B, T, H] (one per head), explicit scale."""
    pytest.importorskip("fla")
    from fla.ops.simple_gla.naive import naive_chunk_simple_gla, naive_recurrent_simple_gla

    q, k, v, log_alpha, s0 = _inputs(2, 45, 2, 8, 6, "scalar", seed=10)
    o, S = chunk_decay(q, k, v, log_alpha, 0.5, s0, True, chunk_size=16)
    o_ref, S_ref = naive_recurrent_simple_gla(q, k, v, log_alpha, scale=0.5, initial_state=s0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S, S_ref, atol=2e-5, rtol=1e-4)
    o_ref, S_ref = naive_chunk_simple_gla(q, k, v, log_alpha, initial_state=s0.clone(), output_final_state=True,
                                          chunk_size=16, scale=0.5)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S, S_ref, atol=2e-5, rtol=1e-4)


def test_matches_fla_naive_retention():
    """fla.ops.retention: [B, H, T, D] layout, γ_h = 1 - 2^(-5-h), scale D^-1/2, no state."""
    pytest.importorskip("fla")
    from fla.ops.retention.naive import naive_retention

    from looplm.mixers.retnet import retention_log_decay

    B, T, H = 2, 70, 4
    q, k, v, _, _ = _inputs(B, T, H, 8, 6, "none", seed=11)
    log_alpha = retention_log_decay(H).expand(B, T, H)
    o, _ = chunk_decay(q, k, v, log_alpha, chunk_size=64)
    o_ref = naive_retention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)


def test_matches_fla_naive_linear_attention():
    """fla.ops.linear_attn: α = 1, normalize=False (fla's LinearAttention layer default)."""
    pytest.importorskip("fla")
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn

    q, k, v, _, s0 = _inputs(2, 33, 2, 8, 6, "none", seed=12)
    o_ref, S_ref = naive_recurrent_linear_attn(q, k, v, initial_state=s0, output_final_state=True, normalize=False)
    o, S = chunk_decay(q, k, v, None, None, s0, True, chunk_size=16)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S, S_ref, atol=2e-5, rtol=1e-4)


def test_matches_fla_naive_hgrn():
    """fla.ops.hgrn (HGRN1, h_t = e^{g_t} h_{t-1} + x_t per channel) is the op with one
    head per channel, K = V = 1, q = k = 1 and scale 1."""
    pytest.importorskip("fla")
    from fla.ops.hgrn.naive import naive_recurrent_hgrn

    B, T, D = 2, 41, 6
    g = torch.Generator().manual_seed(13)
    x, gate = torch.randn(B, T, D, generator=g), F.logsigmoid(torch.randn(B, T, D, generator=g))
    h0 = torch.randn(B, D, generator=g)
    o_ref, h_ref = naive_recurrent_hgrn(x, gate, initial_state=h0, output_final_state=True)
    ones = torch.ones(B, T, D, 1)
    o, S = chunk_decay(ones, ones, x[..., None], gate, 1.0, h0[..., None, None], True, chunk_size=16)
    torch.testing.assert_close(o[..., 0], o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(S[..., 0, 0], h_ref, atol=2e-5, rtol=1e-4)


def test_chunk_memory_is_linear_in_length():
    """No T × T tensor: the largest saved activation grows linearly with T."""
    sizes = []
    for T in (256, 512):
        q, k, v, log_alpha, _ = _inputs(1, T, 1, 4, 4, "diagonal", seed=14)
        q.requires_grad_(True)
        largest = [0]

        def pack(t):
            largest[0] = max(largest[0], t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunk_decay(q, k, v, log_alpha, chunk_size=64)
        sizes.append(largest[0])
    assert sizes[1] <= 2 * sizes[0] and sizes[1] < 512 * 512 / 4, sizes
