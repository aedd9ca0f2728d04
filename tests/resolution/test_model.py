"""Multi-resolution loops in the whole model: causality, prefill + decoding = full forward
for every schedule, offset, shift, topology and mixer kind, Algorithm 2's chunk triggers."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopCache, LoopLM
from looplm.config_base import ConfigError
from tests.conftest import random_ids, tiny_config

C2F = "1+1x{1/8,1/4,1/2,1}+1"  # coarse-to-fine (SpiralFormer-B shape)
F2C = "1+1x{1,1/2,1/4,1/8}+1"  # fine-to-coarse (Table 2 row 2)

CASES = [
    ("c2f-mesh", dict(topology="mesh", layout=C2F)),
    ("c2f-anchor-offset0", dict(topology="anchor", layout=C2F, resolution={"offsets": [0, 0, 0, 0]})),
    ("c2f-mesh-parallel", dict(topology="mesh", layout=C2F, resolution={"shifts": [8, 4, 2, 1]})),
    ("f2c-residual-mean-uniform", dict(topology="residual", layout=F2C, resolution={"down": "mean", "up": "uniform"})),
    ("odd-chunks-static-wide-shift", dict(topology="static_combination", layout="1x{1/3,1/5}+1",
                                         resolution={"offsets": [2, 4], "shifts": [5, 4]})),
    ("l-shape-dynamic-unshared", dict(topology="dynamic_combination", layout="2+1x{1/16,1/8,1/4,1/2}+1",
                                      share_core=False)),
    ("c2f-mesh-window", dict(topology="mesh", layout=C2F, mixer={"kind": "sliding_window", "window": 3})),
    ("c2f-anchor-gdn", dict(topology="anchor", layout=C2F, mixer={"kind": "gated_deltanet"})),
    ("c2f-mesh-linear-attention", dict(topology="mesh", layout=C2F, mixer={"kind": "linear_attention"})),
    ("c2f-anchor-neox", dict(topology="anchor", layout=C2F, parallel_residual=True, rotary_pct=0.25)),
]
IDS = [name for name, _ in CASES]


def _model(fields) -> LoopLM:
    torch.manual_seed(0)
    fields = dict(fields)
    return LoopLM(tiny_config(fields.pop("topology"), **fields)).eval()


def _decode(model, x, splits):
    cache = LoopCache()
    pieces, start = [], 0
    for end in splits:
        pieces.append(model(x[:, start:end], cache=cache).logits)
        start = end
    return torch.cat(pieces, dim=1), cache


@pytest.mark.parametrize("name,fields", CASES, ids=IDS)
def test_strict_causality(name, fields):
    model = _model(fields)
    x = random_ids(2, 21)
    base = model(x).logits
    for j in (0, 3, 11, 20):
        y = x.clone()
        y[:, j] = (y[:, j] + 7) % 61
        changed = model(y).logits
        torch.testing.assert_close(changed[:, :j], base[:, :j], atol=1e-6, rtol=0)
        assert (changed[:, j] - base[:, j]).abs().max() > 1e-6


@pytest.mark.parametrize("name,fields", CASES, ids=IDS)
def test_prefill_and_decoding_equal_full_forward(name, fields):
    model = _model(fields)
    L = 22
    x = random_ids(2, L, seed=1)
    full = model(x).logits
    for prefill in (1, 12):  # prefill ends mid-chunk / just past a g = 8 chunk
        out, cache = _decode(model, x, [prefill, *range(prefill + 1, L + 1)])
        torch.testing.assert_close(out, full, atol=2e-5, rtol=1e-5)
    out, _ = _decode(model, x, [3, 4, 13, 17, 22])  # chunked prefill completing several chunks at once
    torch.testing.assert_close(out, full, atol=2e-5, rtol=1e-5)
    assert cache.get_seq_length() == L


def test_length_does_not_change_earlier_outputs():
    """Complete chunks are kept whatever follows (L_t = ⌊(L + ω)/g⌋), so a prefix's logits do
    not depend on the total length; Eq. (13)'s ⌊L/g⌋ would drop chunk 1 at L = 12 (g=8, ω=4)."""
    model = _model(dict(topology="mesh", layout="1x{1/8}+1"))
    x = random_ids(1, 20, seed=2)
    long_ = model(x).logits
    for L in (11, 12, 13):
        torch.testing.assert_close(model(x[:, :L]).logits, long_[:, :L], atol=2e-5, rtol=1e-5)


def _core_calls(model, x):
    """Calls of the first core block per decoded position, counted by a hook."""
    calls = []
    handle = model.core[0][0].register_forward_hook(lambda *_: calls.append(1))
    cache, counts = LoopCache(), []
    try:
        for i in range(x.shape[1]):
            before = len(calls)
            model(x[:, i : i + 1], cache=cache)
            counts.append(len(calls) - before)
    finally:
        handle.remove()
    return counts, cache


@pytest.mark.parametrize("offsets,expected_max", [([0, 0, 0, 0], 4), (None, 2)])
def test_trigger_pattern_of_appendix_d(offsets, expected_max):
    """ω = 0 stacks every resolution's trigger on i ≡ 7 (mod 8); ω = ⌊g/2⌋ interleaves them."""
    model = _model(dict(topology="mesh", layout=C2F, resolution={"offsets": offsets}))
    L = 32
    counts, cache = _core_calls(model, random_ids(1, L, seed=3))
    triggers = cache.coarse_triggers()
    per_position = [1 + sum(i in positions for positions in triggers.values()) for i in range(L)]  # + full res
    assert counts == per_position, "the coarse core runs exactly when a chunk completes"
    for t, g in enumerate((8, 4, 2)):
        w = g // 2 if offsets is None else 0
        assert triggers[t] == [i for i in range(L) if i % g == (g - 1 - w) % g and i + w >= g - 1]  # Eq. (31)
    assert max(counts) == expected_max
    if offsets is not None:
        assert counts[0] == 1 and counts[7] == 4


def test_parallel_regime_latents_are_ready_before_the_token():
    """s >= g: after decoding positions < i, the latent position i reads is already cached."""
    model = _model(dict(topology="anchor", layout=C2F, resolution={"shifts": [8, 5, 2, 1]}))
    x = random_ids(1, 30, seed=4)
    cache = LoopCache()
    for i in range(30):
        for t, chunk in cache.chunks.items():
            src = chunk.resolution.source_chunk(i)
            assert src is None or src < chunk.latents.shape[1], (t, i)
        model(x[:, i : i + 1], cache=cache)


def test_core_lengths_match_the_positions_the_core_processes():
    model = _model(dict(topology="mesh", layout="1+1x{1/8,1/4,1/2,1}+1", resolution={"offsets": [0, 1, 1, 0]}))
    seen = []
    handle = model.core[0][0].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    model(random_ids(2, 37))
    handle.remove()
    assert seen == model.cfg.core_lengths(37) == [4, 9, 19, 37]


def test_crop_and_select_batch():
    model = _model(dict(topology="mesh", layout=C2F))
    x = random_ids(3, 20, seed=5)
    full = model(x).logits
    cache = LoopCache()
    model(x[:, :16], cache=cache)
    cache.crop(15)  # the current chunks start at 12, 14, 15 (g = 8, 4, 2 with ω = 4, 2, 1)
    torch.testing.assert_close(model(x[:, 15:16], cache=cache).logits[:, 0], full[:, 15], atol=2e-5, rtol=1e-5)
    cache.select_batch(torch.tensor([2, 0]))
    torch.testing.assert_close(model(x[[2, 0], 16:17], cache=cache).logits[:, 0], full[[2, 0], 16],
                               atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot crop a multi-resolution cache"):
        cache.crop(5)


def test_left_padding_is_refused():
    model = _model(dict(topology="mesh", layout=C2F))
    x = random_ids(2, 9)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="left-padded batches are not supported"):
        model(x, attention_mask=mask)
    model(x, attention_mask=torch.ones_like(x))  # an all-ones mask is fine


def test_iteration_count_override_is_refused():
    model = _model(dict(topology="anchor", layout=C2F))
    with pytest.raises(ConfigError, match="one resolution per trained iteration"):
        model(random_ids(1, 5), iterations=2)


def test_parameters_per_iteration():
    """A^(t): d -> 1 and B^(t): d -> g_t per iteration with g_t > 1; none at full resolution."""
    model = _model(dict(topology="mesh", layout=C2F))
    names = {n: tuple(p.shape) for n, p in model.resolution.named_parameters()}
    assert names == {
        **{f"down_ops.{t}.scorer.weight": (1, 32) for t in "012"},
        **{f"down_ops.{t}.scorer.bias": (1,) for t in "012"},
        "up_ops.0.router.weight": (8, 32), "up_ops.1.router.weight": (4, 32), "up_ops.2.router.weight": (2, 32),
        "up_ops.0.router.bias": (8,), "up_ops.1.router.bias": (4,), "up_ops.2.router.bias": (2,),
    }
    plain = _model(dict(topology="mesh", layout="1+1x{1,1,1,1}+1"))
    assert plain.resolution is None
