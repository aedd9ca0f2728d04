"""Multi-resolution iterations on the static cache (issue 30): prefill + token-by-token and
chunked decoding against preallocated buffers equal the full forward for every schedule,
offset, shift, up-scaling kind and prompt length; buffers never move; crop and beam reorder
work in place or are refused by name."""

from __future__ import annotations

import pytest
import torch

from looplm import LoopCache, LoopLM
from looplm.cache import NotStatic
from looplm.config import load_config
from looplm.mixers.attention import StaticKVState
from looplm.resolution.state import StaticChunkState
from tests.conftest import random_ids, tiny_config
from tests.invariants import assert_static_decodes_like_full_forward
from tests.test_model_invariants import MIXER_SPECS

CONFIGS = {
    "spiralformer-b-tiny": lambda: load_config("spiralformer-b-tiny").model,
    "spiralformer-l-tiny": lambda: load_config("spiralformer-l-tiny").model,
    "c2f-router": lambda: tiny_config("mesh", layout="2+1x{1/8,1/4,1/2,1}+2"),
    "c2f-offset0-parallel": lambda: tiny_config("anchor", layout="2+1x{1/8,1/4,1/2,1}+2",
                                                resolution={"offsets": [0, 0, 0, 0], "shifts": [8, 5, 2, 0]}),
    "half-uniform-mean": lambda: tiny_config("anchor", layout="2+1x{1/2,1}+2", resolution={"down": "mean", "up": "uniform"}),
    "odd-chunks-wide-shift": lambda: tiny_config("static_combination", layout="1x{1/3,1/5}+1",
                                                 resolution={"offsets": [2, 4], "shifts": [5, 4]}),
    "c2f-window-core": lambda: tiny_config("mesh", layout="1+1x{1/8,1/4,1/2,1}+1",
                                           mixer={"kind": "sliding_window", "window": 3}),
    "c2f-gdn-core": lambda: tiny_config("anchor", layout="1+1x{1/8,1/4,1/2,1}+1", mixer={"kind": "gated_deltanet"}),
}


def _model(name: str) -> LoopLM:
    torch.manual_seed(0)
    return LoopLM(CONFIGS[name]()).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("prefill", [8, 11, 13])  # past every first chunk (g <= 16, ω = g/2); not multiples of g
def test_static_prefill_and_decoding_equal_full_forward(name, prefill):
    model = _model(name)
    x = random_ids(2, 37, vocab=model.cfg.vocab_size, seed=prefill)
    with torch.no_grad():
        tokens = [prefill, *range(prefill + 1, 38)]
        assert assert_static_decodes_like_full_forward(model, x, tokens, atol=2e-5, capacity=40) is None
        chunked = [prefill, prefill + 1, prefill + 4, prefill + 5, prefill + 21, 37]  # pieces completing several chunks
        assert assert_static_decodes_like_full_forward(model, x, chunked, atol=2e-5, capacity=40) is None


def test_static_buffers_never_move_and_are_sized_for_the_capacity():
    model = _model("spiralformer-b-tiny")
    x = random_ids(2, 30, vocab=model.cfg.vocab_size)
    cache = LoopCache(full_loop=True)
    with torch.no_grad():
        model(x[:, :9], cache=cache)
        static = cache.static(30)
        buffers = [t.data_ptr() for t in static.tensors()]
        for i in range(9, 30):
            model(x[:, i : i + 1], cache=static)
    assert [t.data_ptr() for t in static.tensors()] == buffers
    for t, chunk in static.chunks.items():
        it = chunk.resolution
        assert isinstance(chunk, StaticChunkState)
        assert chunk.pending.shape[1] == it.chunk and chunk.updates.shape[1] == 30 + it.shift
        assert chunk.valid.shape[1] == it.complete_chunks(30) and bool(chunk.valid.all())  # 30 positions: all complete
        coarse = [s for (block, p), s in static.states.items() if block.startswith("core.") and p == t]
        assert coarse and all(isinstance(s, StaticKVState) and s.keys.shape[2] == it.complete_chunks(30)
                              for s in coarse)
    grown = LoopCache()
    with torch.no_grad():
        model(x, cache=grown)
    assert static.coarse_triggers() == grown.coarse_triggers()


def test_static_cache_waits_for_the_first_chunk():
    model = _model("spiralformer-l-tiny")  # g = 16, ω = 8: the first chunk ends at position 7
    cache = LoopCache(full_loop=True)
    with torch.no_grad():
        model(random_ids(1, 7, vocab=model.cfg.vocab_size), cache=cache)
    with pytest.raises(NotStatic, match=r"iteration 0: its first chunk \(g=16, ω=8\) completes at position 7") as error:
        cache.static(32)
    assert error.value.after == 8


def _prefilled(model: LoopLM, x: torch.Tensor, prefill: int, capacity: int):
    """(the full forward's logits of x, a static cache for ``capacity`` positions holding
    x[:, :prefill])."""
    cache = LoopCache(full_loop=True)
    with torch.no_grad():
        full = model(x).logits
        model(x[:, :prefill], cache=cache)
    return full, cache.static(capacity)


def test_static_crop_and_beam_reorder():
    model = _model("c2f-router")
    x = random_ids(3, 24, seed=5)
    full, static = _prefilled(model, x, 13, 32)
    with torch.no_grad():
        buffers = [t.data_ptr() for t in static.tensors()]
        model(x[:, 13:16], cache=static)
        static.crop(15)  # the current chunks start at 12, 14, 15 (g = 8, 4, 2 with ω = 4, 2, 1)
        torch.testing.assert_close(model(x[:, 15:16], cache=static).logits[:, 0], full[:, 15], atol=2e-5, rtol=1e-5)
        for i in range(16, 20):
            model(x[:, i : i + 1], cache=static)
        static.select_batch(torch.tensor([2, 0, 1]))  # a beam reorder keeps the batch: in place
        assert [t.data_ptr() for t in static.tensors()] == buffers
        out = [model(x[[2, 0, 1], i : i + 1], cache=static).logits[:, 0] for i in range(20, 24)]
        torch.testing.assert_close(torch.stack(out, dim=1), full[[2, 0, 1], 20:24], atol=2e-5, rtol=1e-5)
        with pytest.raises(ValueError, match=r"cannot crop a multi-resolution cache \(g=8, ω=4\) to 19 positions"):
            static.crop(19)  # chunk 12..19 of g = 8 completed at 19: its buffer is gone


def test_static_crop_of_a_recurrent_coarse_core():
    """A recurrent state summarises every chunk: a crop that loses no completed chunk keeps
    it; one that loses a chunk is refused, naming the block."""
    torch.manual_seed(0)
    model = LoopLM(tiny_config("anchor", layout="1x{1/8,1/4}", mixer={"kind": "gated_deltanet"},
                               resolution={"offsets": [0, 0]})).eval()
    x = random_ids(2, 20, seed=6)
    full, static = _prefilled(model, x, 13, 24)
    with torch.no_grad():
        model(x[:, 13:18], cache=static)
        static.crop(16)  # a boundary of both iterations' chunks, and no completed chunk is lost
        out = [model(x[:, i : i + 1], cache=static).logits[:, 0] for i in range(16, 20)]
        torch.testing.assert_close(torch.stack(out, dim=1), full[:, 16:20], atol=2e-5, rtol=1e-5)
        with pytest.raises(ValueError, match=r"block core\.0 \(pass 0\) holds a DeltaRuleState, which cannot be rewound"):
            static.crop(8)  # a boundary too, but chunks 8..15 (g = 8) and three of g = 4 are in the states


def test_a_static_cache_without_chunk_states_is_refused_by_name():
    """A static cache filled by a model of the same blocks but full-resolution iterations
    holds no chunk state for a multi-resolution one."""
    torch.manual_seed(0)
    looped = LoopLM(tiny_config("mesh", layout="1+1R2+1")).eval()
    spiral = LoopLM(tiny_config("mesh", layout="1+1x{1/2,1}+1")).eval()
    x = random_ids(1, 6)
    cache = LoopCache(full_loop=True)
    with torch.no_grad():
        looped(x[:, :5], cache=cache)
        with pytest.raises(ValueError, match="static cache holds no chunk state for multi-resolution iteration 0"):
            spiral(x[:, 5:], cache=cache.static(8))


@pytest.mark.parametrize("mixer", MIXER_SPECS, ids=[str(sorted(m.items())) for m in MIXER_SPECS])
def test_every_mixer_kind_decodes_statically_at_coarse_resolution(mixer):
    torch.manual_seed(0)
    model = LoopLM(tiny_config("mesh", layout="1+1x{1/8,1/4,1/2,1}+1", mixer=mixer)).eval()
    x = random_ids(2, 30)
    with torch.no_grad():
        for ends in ([9, *range(10, 31)], [9, 10, 14, 22, 30]):
            assert assert_static_decodes_like_full_forward(model, x, ends, atol=2e-5, capacity=32) is None
