"""Softmax attention: sliding window semantics, the SDPA output gate, window caches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looplm import LoopCache, LoopLM
from looplm.accounting.dispatch import count_dispatch
from looplm.config_base import ConfigError
from looplm.mixers import MixerContext
from looplm.mixers.attention import RING_SPARE, SoftmaxAttention, blocked_window_attention
from looplm.model_config import ModelConfig
from looplm.modules.rotary import Rotary
from tests.conftest import random_ids, tiny_config
from tests.invariants import error_ratio


def _influence(model: LoopLM, length: int) -> torch.Tensor:
    """[i, j] = True where input position j changes the logits at position i (via gradients)."""
    x = random_ids(1, length)
    emb = model.embed(x).detach().requires_grad_(True)
    influence = torch.zeros(length, length, dtype=torch.bool)
    original = model.embed.forward
    model.embed.forward = lambda ids: emb  # feed the leaf tensor through the model
    try:
        logits = model(x).logits[0]
        for i in range(length):
            (grad,) = torch.autograd.grad(logits[i].sum(), emb, retain_graph=True)
            influence[i] = grad[0].abs().sum(-1) > 0
    finally:
        model.embed.forward = original
    return influence


@pytest.mark.parametrize("window,blocks", [(1, 1), (3, 1), (3, 2), (4, 3)])
def test_sliding_window_receptive_field_of_a_dense_stack(window, blocks):
    model = LoopLM(tiny_config("base", layout=str(blocks), mixer={"kind": "sliding_window", "window": window}))
    reach = _influence(model, 12)
    span = blocks * (window - 1)  # each block reaches w - 1 positions further back
    i, j = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
    torch.testing.assert_close(reach, (j <= i) & (i - j <= span))


@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_looped_sliding_window_receptive_field_grows_with_iterations(iterations):
    """LT2 §2.2: looping a windowed block T times lets information travel T·(w-1) back."""
    window = 3
    cfg = tiny_config("base", layout=f"2R{iterations}", mixer={"kind": "sliding_window", "window": window})
    reach = _influence(LoopLM(cfg), 16)
    span = 2 * iterations * (window - 1)
    i, j = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    torch.testing.assert_close(reach, (j <= i) & (i - j <= span))


def test_window_cache_keeps_the_last_w_minus_1_positions_and_the_spare_ones():
    """w − 1 keys for the next query and RING_SPARE more, so a crop can rewind that far."""
    window, n = 4, RING_SPARE + 24
    model = LoopLM(tiny_config("anchor", mixer={"kind": "sliding_window", "window": window})).eval()
    x = random_ids(2, n)
    cache = LoopCache()
    model(x[:, :7], cache=cache)
    for i in range(7, n):
        model(x[:, i : i + 1], cache=cache)
    state = cache.get("core.0", 1)
    kept = window - 1 + RING_SPARE
    assert state.keys.shape[2] == kept and state.start == n - kept
    shortest = n - RING_SPARE  # its query reads positions from n - kept on: the first kept one
    with pytest.raises(ValueError, match="already dropped"):
        cache.crop(shortest - 1)
    assert cache.get_seq_length() == n and cache.get("core.0", 1).start == n - kept  # a refused crop changes nothing
    cache.crop(shortest)
    full = model(x).logits
    got = torch.cat([model(x[:, i : i + 1], cache=cache).logits for i in range(shortest, n)], 1)
    torch.testing.assert_close(got, full[:, shortest:], atol=2e-5, rtol=1e-5)


def test_window_cache_crop_before_dropping_decodes_like_the_full_forward():
    """A crop that keeps every key the next query's window reads (nothing dropped yet) is exact."""
    model = LoopLM(tiny_config("anchor", mixer={"kind": "sliding_window", "window": 8})).eval()
    x = random_ids(2, 9)
    full = model(x).logits
    cache = LoopCache()
    model(x[:, :6], cache=cache)
    cache.crop(4)
    got = torch.cat([model(x[:, i : i + 1], cache=cache).logits for i in range(4, 9)], 1)
    torch.testing.assert_close(got, full[:, 4:], atol=2e-5, rtol=1e-5)


def test_output_gate_is_sigmoid_of_the_input_elementwise():
    torch.manual_seed(0)
    dim, heads = 16, 4
    gated = SoftmaxAttention(dim, heads, heads, bias=False, output_gate=True)
    plain = SoftmaxAttention(dim, heads, heads, bias=False)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("gate")})
    x = torch.randn(2, 5, dim)
    positions = torch.arange(5).expand(2, 5)
    ctx = MixerContext(rope=Rotary(4, 10000.0)(positions, x.dtype), valid=torch.ones(2, 5, dtype=torch.bool), past=0, padded=False)
    out_gated, _ = gated(x, ctx)
    plain.o_proj = torch.nn.Identity()
    y, _ = plain(x, ctx)
    torch.testing.assert_close(out_gated, gated.o_proj(y * torch.sigmoid(gated.gate(x))))


@pytest.mark.parametrize(
    "mixer,fragment",
    [({"kind": "attention", "window": 4}, "unknown key"), ({"kind": "sliding_window", "window": 0}, ">= 1"),
     ({"kind": "lstm"}, "one of attention"), ({"kind": "sliding_window", "window": "x"}, "an integer")],
)
def test_mixer_config_errors(mixer, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ModelConfig.from_dict({"mixer": mixer}, prefix="model")


@pytest.mark.parametrize("mixer", [{"kind": "attention"}, {"kind": "sliding_window", "window": 3}])
def test_recorded_attention_probabilities_reproduce_the_output(mixer):
    model = LoopLM(tiny_config("mesh", layout="1+1R2+1", mixer=mixer)).eval()
    x = random_ids(2, 7)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    plain = model(x, attention_mask=mask)
    probed = model(x, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(probed.logits, plain.logits, atol=1e-5, rtol=1e-5)
    assert sorted(probed.attentions) == [("coda.0", 0), ("core.0", 0), ("core.0", 1), ("prelude.0", 0)]
    probs = probed.attentions[("core.0", 1)]
    assert probs.shape == (2, 4, 7, 7)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 7))
    assert probs[1].triu(1).abs().max() == 0  # causal
    assert probs[0, :, 2:, :2].abs().max() == 0  # real queries never look at padding
    if "window" in mixer:
        assert probs[1].tril(-3).abs().max() == 0
    assert plain.attentions is None


@pytest.mark.parametrize("length,window", [(1, 3), (7, 3), (300, 3), (257, 128), (301, 130), (513, 512),
                                           (200, 1000)])
def test_blocked_window_attention_equals_the_masked_full_attention(length, window):
    """The O(T·w) training path against SDPA with the full T × T band mask, forward and
    backward, on odd lengths and windows smaller and larger than T."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, length, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - window))
    got = blocked_window_attention(q, k, v, window)
    torch.testing.assert_close(got, expected)
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("window", [5, 200])
def test_sliding_window_layer_blocked_path_equals_the_masked_path(window):
    """A windowed layer over T > block positions takes the blocked path; with attention
    probabilities requested it takes the explicit masked one. Same outputs and gradients
    (grouped-query heads and the output gate included)."""
    torch.manual_seed(0)
    layer = SoftmaxAttention(32, 4, 2, bias=True, window=window, output_gate=True).double()
    length = 301
    x = torch.randn(2, length, 32, dtype=torch.float64)
    positions = torch.arange(length).expand(2, length)

    def run(attentions):
        ctx = MixerContext(rope=Rotary(8, 10000.0)(positions, x.dtype), valid=torch.ones(2, length, dtype=torch.bool),
                           past=0, padded=False, attentions=attentions)
        y, state = layer(x, ctx)
        grads = torch.autograd.grad(y.square().sum(), list(layer.parameters()))
        return y, state, grads

    blocked, masked = run(None), run({})
    tol = dict(atol=1e-5, rtol=1e-4)  # the explicit path takes its softmax in float32
    torch.testing.assert_close(blocked[0], masked[0], **tol)
    torch.testing.assert_close(blocked[1].keys, masked[1].keys)
    assert blocked[1].start == masked[1].start == length - (window - 1 + RING_SPARE)
    for a, b in zip(blocked[2], masked[2]):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("window", [3, 4])
def test_a_window_crop_into_dropped_keys_is_refused_and_changes_nothing(window):
    """The growing cache keeps the last w − 1 + RING_SPARE keys: after n positions, the
    query at n − RING_SPARE − 1 would need a key already dropped, so that crop is refused
    (it used to attend over a truncated window) and the cache decodes on as if never asked."""
    torch.manual_seed(0)
    model = LoopLM(tiny_config("base", layout="1", mixer={"kind": "sliding_window", "window": window})).eval()
    n = RING_SPARE + 14
    x = random_ids(3, n + 1)
    full = model(x).logits
    cache = LoopCache()
    model(x[:, :n], cache=cache)
    with pytest.raises(ValueError, match=f"cannot crop a sliding-window cache to {n - RING_SPARE - 1}"):
        cache.crop(n - RING_SPARE - 1)
    assert cache.get_seq_length() == n
    torch.testing.assert_close(model(x[:, n:], cache=cache).logits[:, 0], full[:, n], atol=2e-5, rtol=1e-5)


def test_a_refused_crop_leaves_every_layer_of_the_cache_as_it_was():
    """A multi-resolution loop: the attention states crop fine, the chunk buffer of the
    half-resolution iteration refuses (a completed chunk cannot be forgotten); no state may
    change before the refusal (they used to be cropped already), and decoding goes on exactly."""
    torch.manual_seed(0)
    model = LoopLM(tiny_config("anchor", layout="1+1x{1/2,1}")).eval()
    x = random_ids(2, 9)
    full = model(x).logits
    cache = LoopCache()
    model(x[:, :8], cache=cache)
    before = {key: state.keys.shape[2] for key, state in cache.states.items()}
    with pytest.raises(ValueError, match="cannot crop a multi-resolution cache"):
        cache.crop(6)  # the chunk of positions 5-6 (offset ω = 1) completed and released its buffer
    assert {key: state.keys.shape[2] for key, state in cache.states.items()} == before
    assert cache.get_seq_length() == 8
    torch.testing.assert_close(model(x[:, 8:9], cache=cache).logits[:, 0], full[:, 8], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads,rotary_dim,ops", [(4, 4, 15), (2, 4, 15), (4, 2, 16)],
                         ids=["mha", "gqa", "partial-rotary"])
def test_a_training_step_of_an_attention_layer_launches_fifteen_operators(kv_heads, rotary_dim, ops):
    """Forward and backward of one attention layer (issue 25), 15 operators: forward the
    q/k/v product, the rotation of q and k (three), SDPA and W_O; backward W_O's two
    products, SDPA's backward, the split and rotation's hand-written four
    (modules/rotary.py:split_rotated_qkv, where autograd's slices of the one projection took
    nine) and the q/k/v product's two. Partial rotary joins its pass-through channels back
    (one more); grouped-query heads are read by SDPA itself (``enable_gqa``), not repeated
    to every query head and their gradients summed back (four more, until they were). No
    slice of the projection is zero-padded and summed."""
    torch.manual_seed(0)
    layer = SoftmaxAttention(16, 4, kv_heads, bias=False)
    x = torch.randn(2, 5, 16, requires_grad=True)
    positions = torch.arange(5).expand(2, 5)
    ctx = MixerContext(rope=Rotary(rotary_dim, 10000.0)(positions, x.dtype), valid=torch.ones(2, 5, dtype=torch.bool),
                       past=0, padded=False)
    grad = torch.ones(2, 5, 16)

    def step():
        y, _ = layer(x, ctx)
        y.backward(grad)

    step()
    layer.zero_grad(set_to_none=True)  # as between training steps
    x.grad = None
    counts, _ = count_dispatch(step)
    assert counts.syncs == 0 and "aten.slice_backward" not in counts.by_op, counts.by_op
    assert counts.ops <= ops, counts.by_op


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("sdpa_groups", [True, False], ids=["enable_gqa", "copies"])
def test_grouped_heads_read_in_place_equal_the_repeated_heads(device, dtype, padded, sdpa_groups, monkeypatch):
    """Grouped K/V heads read in place (SDPA's ``enable_gqa`` over several positions where
    ``reads_grouped_heads`` says so, else copies; one position folded by ``attend_grouped``)
    compute what SDPA computes over K/V repeated to every query head: the output, a decode
    step against the cache and every gradient, with a padding mask and without."""
    from looplm.mixers import attention

    torch.manual_seed(0)
    layer = SoftmaxAttention(64, 8, 2, bias=False).to(device)
    x = torch.randn(2, 9, 64, device=device)
    valid = torch.ones(2, 9, dtype=torch.bool, device=device)
    if padded:
        valid[1, :3] = False
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    rope = Rotary(8, 10000.0)(positions, torch.float32)

    def repeated(q, keys, values, mask, is_causal=False):
        G = q.shape[1] // keys.shape[1]
        return F.scaled_dot_product_attention(q, keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1),
                                              attn_mask=mask, is_causal=is_causal)

    def run(reference: bool):
        with monkeypatch.context() as patch:
            patch.setattr(attention, "reads_grouped_heads", lambda q, mask: sdpa_groups)
            if reference:
                patch.setattr(attention, "attend_grouped", repeated)
            layer.zero_grad(set_to_none=True)
            inputs = x.clone().requires_grad_()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                ctx = MixerContext(rope=rope, valid=valid, past=0, padded=padded)
                y, _ = layer(inputs, ctx)
                y.float().square().sum().backward()
                prefill = MixerContext(rope=tuple(t[:, :-1] for t in rope), valid=valid[:, :-1], past=0,
                                       padded=padded)
                step = MixerContext(rope=tuple(t[:, -1:] for t in rope), valid=valid, past=8, padded=padded)
                last, _ = layer(x[:, -1:], step, layer(x[:, :-1], prefill)[1])
        return [y, last, inputs.grad, *(p.grad for p in layer.parameters())]

    for a, b in zip(run(False), run(True)):
        if dtype == torch.float32 and device == "cpu":
            torch.testing.assert_close(a, b)
        else:  # bf16 gradients of K/V summed over their group in another order
            assert error_ratio(a, b) < 1e-2


def test_a_decoding_step_reads_grouped_heads_without_copying_the_cache(monkeypatch):
    """One new position folds each group's query heads into the query axis (attend_grouped):
    no tensor of the cache's keys or values repeated to every query head, with a padding mask
    and where SDPA could not read grouped heads itself (CUDA with a mask: reads_grouped_heads
    False, as here)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from looplm.mixers import attention

    monkeypatch.setattr(attention, "reads_grouped_heads", lambda q, mask: False)

    torch.manual_seed(0)
    layer = SoftmaxAttention(64, 8, 2, bias=False).eval()
    x = torch.randn(2, 9, 64)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False
    rope = Rotary(8, 10000.0)((valid.long().cumsum(1) - 1).clamp(min=0), torch.float32)
    prefill = MixerContext(rope=tuple(t[:, :-1] for t in rope), valid=valid[:, :-1], past=0, padded=True)
    step = MixerContext(rope=tuple(t[:, -1:] for t in rope), valid=valid, past=8, padded=True)
    shapes = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes.extend(tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(t, torch.Tensor))
            return out

    with torch.no_grad():
        state = layer(x[:, :-1], prefill)[1]
        with Shapes():
            layer(x[:, -1:], step, state)
    assert (2, 2, 9, 8) in shapes  # the cache, read as it is
    assert not [s for s in shapes if len(s) == 4 and s[1] == 8 and s[2] > 1], shapes  # never repeated to 8 heads
