"""The two model-level invariant checks (DESIGN.md 1-2), shared by every test grid."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from looplm import LoopCache
from looplm.cache import NotStatic


def assert_strictly_causal(model, x: torch.Tensor, positions: Sequence[int], *, shift: int, vocab: int = 61,
                           atol: float = 1e-6) -> None:
    """Changing token j leaves the logits before j unchanged and changes those at j."""
    base = model(x).logits
    for j in positions:
        y = x.clone()
        y[:, j] = (y[:, j] + shift) % vocab
        changed = model(y).logits
        torch.testing.assert_close(changed[:, :j], base[:, :j], atol=atol, rtol=0)
        assert (changed[:, j] - base[:, j]).abs().max() > 1e-6, "token j must influence its own logits"


def assert_decodes_like_full_forward(model, x: torch.Tensor, splits: Sequence[Sequence[int]], *,
                                     atol: float, rtol: float = 1e-5) -> None:
    """For each list of end points, feeding x piece by piece against one cache gives the
    logits of one full forward (prefill + token-by-token, chunked prefill)."""
    full = model(x).logits
    for ends in splits:
        cache, start, pieces = LoopCache(), 0, []
        for end in ends:
            pieces.append(model(x[:, start:end], cache=cache).logits)
            start = end
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=atol, rtol=rtol)
        assert cache.get_seq_length() == x.shape[1]


def assert_static_decodes_like_full_forward(model, x: torch.Tensor, ends: Sequence[int], *, atol: float,
                                            rtol: float = 1e-5, capacity: int = 0) -> Optional[str]:
    """Cache equivalence on the static cache: a prefill of x[:, :ends[0]] into a growing
    full-loop cache, then the rest piece by piece against its static form (buffers for ``capacity``,
    default the length, positions), equal to one full forward. Returns None, or why the
    cache has no static form (then nothing else is checked)."""
    full = model(x).logits
    cache = LoopCache(full_loop=True)  # as generate(compile=...) fills it: no early exit
    pieces = [model(x[:, : ends[0]], cache=cache).logits]
    try:
        static = cache.static(max(capacity, x.shape[1]))
    except NotStatic as reason:
        return str(reason)
    for start, end in zip(ends, ends[1:]):
        pieces.append(model(x[:, start:end], cache=static).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=atol, rtol=rtol)
    assert static.get_seq_length() == x.shape[1]
    return None


def error_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ (RMS), the measure fla's tests compare kernels by: it
    tolerates TF32-level rounding of fla's fp32 kernels without hiding a wrong result."""
    diff = (actual.float() - expected.float()).pow(2).mean().sqrt()
    return (diff / expected.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


def prefill_then_tokens(prefill: int, length: int) -> list[int]:
    """End points of a prefill of ``prefill`` tokens followed by one token at a time."""
    return [prefill, *range(prefill + 1, length + 1)]
