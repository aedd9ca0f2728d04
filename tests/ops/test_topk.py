"""The sparse mixers' top-k (``topk_indices``): exact, deterministic, ties to the later
position, -0.0 equal to 0.0, -inf entries flagged; checked against a float64 stable sort,
and blind to masked entries after a query (a decoding step's row is a full forward's row cut
short), which is what makes DSA's decoding pick the full forward's keys."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from looplm.ops.sparse import topk_indices, topk_mask

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
#: few distinct values, so rows are full of ties; signed zeros, infinities, tiny and huge values
VALUES = [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 1e-30, -1e-30, 3e4, -3e4, float("inf"), float("-inf")]


def reference(row: list[float], k: int) -> tuple[list[int], list[bool]]:
    """Positions of the k largest by (value, position), both descending: Python's stable sort
    over float64 values (-0.0 == 0.0 there)."""
    order = sorted(range(len(row)), key=lambda i: (row[i], i), reverse=True)[:k]
    return order, [row[i] > float("-inf") for i in order]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 3).flatmap(
        lambda r: st.lists(st.lists(st.sampled_from(VALUES) | st.floats(-4, 4, width=16), min_size=1, max_size=40),
                           min_size=r, max_size=r)
    ),
    k=st.integers(1, 45),
    dtype=st.sampled_from(DTYPES),
)
def test_topk_indices_equals_a_stable_sort_reference(rows, k, dtype):
    n = min(len(r) for r in rows)
    rows = [r[:n] for r in rows]
    scores = torch.tensor(rows, dtype=torch.float64).to(dtype)
    exact = scores.double().tolist()  # the values as the dtype holds them, in float64
    index, keep = topk_indices(scores, k)
    assert index.shape == keep.shape == (len(rows), min(k, n)) and index.dtype == torch.long
    for b, row in enumerate(exact):
        ref_index, ref_keep = reference(row, k)
        assert index[b].tolist() == ref_index
        assert keep[b].tolist() == ref_keep
    mask = topk_mask(scores, k)
    assert mask.sum() == keep.sum() and bool(mask.gather(-1, index)[keep].all())


@settings(max_examples=40, deadline=None)
@given(
    row=st.lists(st.sampled_from(VALUES[:10]), min_size=2, max_size=30),
    k=st.integers(1, 12),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_masked_later_entries_do_not_change_the_choice(row, k, dtype, data):
    """Query t's row in a full forward has -inf after t; in decoding it ends at t."""
    t = data.draw(st.integers(0, len(row) - 1))
    full = torch.tensor(row, dtype=torch.float64).to(dtype)
    full[t + 1:] = float("-inf")
    short = full[: t + 1]
    index_full, keep_full = topk_indices(full, k)
    index_short, keep_short = topk_indices(short, k)
    assert index_full[keep_full].tolist() == index_short[keep_short].tolist()


def test_ties_go_to_the_later_position_and_signed_zeros_are_equal():
    for dtype in DTYPES:
        scores = torch.tensor([[0.0, 2.0, -0.0, 0.0, float("-inf"), 1.0, -0.0]], dtype=dtype)
        index, keep = topk_indices(scores, 4)
        assert index.tolist() == [[1, 5, 6, 3]], dtype  # 2.0, 1.0, then the last two zeros (-0.0 at 6)
        assert keep.all()
        index, keep = topk_indices(scores, 10)  # k above the length: all, -inf last and flagged
        assert index.tolist() == [[1, 5, 6, 3, 2, 0, 4]] and keep.tolist() == [[True] * 6 + [False]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_indices_on_large_rows_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(-5, 5, (3, 5000), generator=g).to(dtype) * 0.5  # many ties
    index, _ = topk_indices(scores, 300)
    for b in range(3):
        assert index[b].tolist() == reference(scores[b].double().tolist(), 300)[0]
