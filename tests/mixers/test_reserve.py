"""Caches that grow in place (looplm.mixers.reserve): extend equals torch.cat, writes into
spare rows without copying, grows by a quarter when full, never changes rows an older or
branched view can see, and falls back to cat under autograd; decoding with attention, a
sliding window, DSA and NSA appends in place and still equals the full forward, also when
two continuations branch from one cache."""

from __future__ import annotations

import copy

import pytest
import torch

from looplm import LoopCache, LoopLM
from looplm.mixers.reserve import MIN_SPARE, extend
from tests.conftest import random_ids, tiny_config


def _steps(n: int, seed: int = 0, rows: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, rows, 4, generator=g) for _ in range(n)]


def test_extend_equals_cat_and_writes_in_place_until_full():
    new = _steps(60)
    view, reserve = new[0], None
    expected = new[0]
    buffers = set()
    for x in new[1:]:
        view, reserve = extend(view, x, 2, reserve)
        expected = torch.cat([expected, x], dim=2)
        torch.testing.assert_close(view, expected, rtol=0, atol=0)
        buffers.add(reserve.buffer.data_ptr())
        assert view.data_ptr() == reserve.buffer.data_ptr() and reserve.end == view.shape[2] <= reserve.capacity
    # allocated for 2 rows (+16 spare), grown at 19 (+16), 36 (+16) and 53 rows (+max(16, 53 / 4))
    assert len(buffers) == 4 and reserve.capacity == 53 + max(MIN_SPARE, 14)
    big, big_reserve = extend(torch.zeros(1, 1, 1000, 1), torch.zeros(1, 1, 1, 1), 2, None)
    assert big_reserve.capacity == 1001 + 251  # a quarter spare


def test_views_handed_out_never_change_and_branches_copy():
    a, b, c = _steps(3, seed=1, rows=5)
    base, reserve = extend(a, b, 2, None)
    snapshot = base.clone()
    left, left_reserve = extend(base, c, 2, reserve)  # base is the tip: in place
    assert left_reserve is reserve and left.data_ptr() == base.data_ptr()
    right, right_reserve = extend(base, -c, 2, reserve)  # base no longer the tip: a new buffer
    assert right_reserve is not reserve
    torch.testing.assert_close(base, snapshot, rtol=0, atol=0)
    torch.testing.assert_close(left, torch.cat([a, b, c], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(right, torch.cat([a, b, -c], dim=2), rtol=0, atol=0)
    cropped = left[:, :, :7]  # a crop is a prefix, not the tip: extending it copies too
    again, again_reserve = extend(cropped, c, 2, left_reserve)
    assert again_reserve is not left_reserve
    torch.testing.assert_close(left, torch.cat([a, b, c], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(again, torch.cat([torch.cat([a, b, c], dim=2)[:, :, :7], c], dim=2), rtol=0, atol=0)


def test_a_sliding_view_at_the_tip_extends_in_place():
    new = _steps(40, seed=2)
    view, reserve = extend(new[0], new[1], 2, None)
    grown = 0
    for i in range(2, len(new)):
        before = reserve.buffer.data_ptr()
        full, reserve = extend(view, new[i], 2, reserve)
        view = full[:, :, -3:]  # a window of 3 rows
        torch.testing.assert_close(view, torch.cat(new[i - 2:i + 1], dim=2), rtol=0, atol=0)
        if reserve.buffer.data_ptr() != before:
            grown += 1
            assert reserve.capacity == 4 + MIN_SPARE  # regrown around the window only, not the history
    assert grown == 2  # at rows 19 and 35 of 40


def test_under_autograd_extend_is_cat_and_keeps_gradients():
    a = torch.randn(1, 2, 3, 4, requires_grad=True)
    b = torch.randn(1, 2, 1, 4, requires_grad=True)
    out, reserve = extend(a, b, 2, None)
    assert reserve is None
    out.sum().backward()
    assert a.grad is not None and b.grad is not None
    with torch.no_grad():
        out, reserve = extend(a, b, 2, None)
    assert reserve is not None and not out.requires_grad


def test_an_inference_buffer_is_copied_outside_inference_mode():
    a, b, c = _steps(3, seed=3)
    with torch.inference_mode():
        view, reserve = extend(a, b, 2, None)
    out, new_reserve = extend(view, c, 2, reserve)  # cannot write an inference tensor here: copies
    assert new_reserve is not reserve
    torch.testing.assert_close(out, torch.cat([a, b, c], dim=2))


def _state_buffers(cache: LoopCache) -> dict:
    return {key: [s.buffer.data_ptr() if s is not None else None for s in state.spare]
            for key, state in cache.states.items() if hasattr(state, "spare")}


MIXERS = {
    "attention": {"kind": "attention"},
    "window": {"kind": "sliding_window", "window": 4},
    "dsa": {"kind": "dsa", "top_k": 3, "index_heads": 2, "index_head_dim": 8},
    "nsa": {"kind": "nsa", "block_size": 2, "select_blocks": 4, "window": 3},
}


@pytest.mark.parametrize("name", list(MIXERS))
def test_decoding_appends_in_place_and_branches_equal_the_full_forward(name):
    torch.manual_seed(0)
    model = LoopLM(tiny_config("base", layout="1R2", mixer=MIXERS[name])).eval()
    ids = random_ids(2, 16)
    with torch.no_grad():
        full = model(ids).logits
        cache = LoopCache()
        model(ids[:, :8], cache=cache)
        model(ids[:, 8:9], cache=cache)  # the first step allocates the buffers
        buffers = _state_buffers(cache)
        assert buffers and all(p is not None for ptrs in buffers.values() for p in ptrs[:2])
        branch = copy.copy(cache)
        branch.states = dict(cache.states)
        for t in range(9, 13):  # within the spare rows: the same buffers
            out = model(ids[:, t:t + 1], cache=cache).logits
            torch.testing.assert_close(out[:, -1], full[:, t], atol=1e-5, rtol=1e-5)
        assert {k: v[:2] for k, v in _state_buffers(cache).items()} == {k: v[:2] for k, v in buffers.items()}
        other = random_ids(2, 1, seed=7)  # a second continuation of the 9-token cache
        out = model(other, cache=branch).logits
        reference = model(torch.cat([ids[:, :9], other], dim=1)).logits
        torch.testing.assert_close(out[:, -1], reference[:, -1], atol=1e-5, rtol=1e-5)
        for t in range(13, 16):  # the first continuation is untouched by the branch
            out = model(ids[:, t:t + 1], cache=cache).logits
            torch.testing.assert_close(out[:, -1], full[:, t], atol=1e-5, rtol=1e-5)


def test_gather_rows_reads_the_picked_rows_of_every_layout():
    from looplm.ops.sparse.common import gather_rows

    g = torch.Generator().manual_seed(4)
    buffer = torch.randn(3, 2, 30, 5, generator=g)
    index = torch.randint(0, 20, (3, 7), generator=g)
    views = [buffer[:, :, :20], buffer[:, :, 4:24], buffer.transpose(2, 3).contiguous().transpose(2, 3)[:, :, :20],
             buffer[:1, :, :20], buffer[:, :, :20].clone()]
    for x in views:
        rows = index[: x.shape[0]]
        expected = torch.stack([x[b][:, rows[b]] for b in range(x.shape[0])])
        torch.testing.assert_close(gather_rows(x, rows), expected, rtol=0, atol=0)
