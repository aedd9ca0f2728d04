"""Decoding caches that grow in place: a key/value tensor appended to along its sequence
dim writes into spare capacity reserved after it, instead of ``torch.cat`` copying the whole
cache on every decoded token (O(S) bytes per step and layer, the cost a sparse mixer's
decoding is meant not to pay).

A cached tensor is a *view* of a larger buffer (:class:`Reserve`); ``Reserve.end`` is the
end of the furthest row any view of that buffer has been given. :func:`extend` writes the
new rows in place only when the view it extends ends exactly there (it is the tip), so the
rows a view can see are never written again: an older state, a cropped state or a second
continuation from the same state (which is then no longer at the tip) stays intact, and
extending it copies into a new buffer instead. When the buffer is full it grows
geometrically (``SPARE``: a quarter more than needed), so a decoded token costs amortised
O(1) copies. While autograd records (a cache used with gradients), extending falls back to
``torch.cat``: an in-place write would modify tensors saved for the backward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

#: spare capacity reserved when a buffer is (re)allocated, as a fraction of the rows needed
SPARE = 0.25
#: at least this many spare rows (short caches, sliding windows)
MIN_SPARE = 16


@dataclasses.dataclass(eq=False)
class Reserve:
    """The buffer behind a growing cache tensor: ``buffer`` has ``capacity`` rows along
    ``dim``; rows before ``end`` have been handed out in views, later ones are free."""

    buffer: torch.Tensor
    end: int
    dim: int

    @property
    def capacity(self) -> int:
        return self.buffer.shape[self.dim]

    def is_tip(self, view: torch.Tensor) -> bool:
        """Whether ``view`` is rows [end - n, end) of the buffer (n = its length along dim),
        with the buffer's layout, so that appending after it writes only free rows."""
        b, n = self.buffer, view.shape[self.dim]
        if n > self.end or view.dtype != b.dtype or view.device != b.device or view.stride() != b.stride():
            return False
        if any(view.shape[d] != b.shape[d] for d in range(b.dim()) if d != self.dim):
            return False
        if b.is_inference() and not torch.is_inference_mode_enabled():
            return False  # an inference tensor cannot be written outside inference mode
        offset = (self.end - n) * b.stride(self.dim) * b.element_size()
        return n > 0 and view.data_ptr() == b.data_ptr() + offset


def extend(
    view: torch.Tensor, new: torch.Tensor, dim: int, reserve: Optional[Reserve]
) -> tuple[torch.Tensor, Optional[Reserve]]:
    """``torch.cat([view, new], dim)`` as a view of ``reserve``'s buffer, written in place
    when ``view`` is its tip and the rows fit, else in a new buffer with ``SPARE`` capacity.
    Returns (the extended view, its reserve; None when autograd records and it was a cat)."""
    if torch.is_grad_enabled() and (view.requires_grad or new.requires_grad):
        return torch.cat([view, new], dim=dim), None
    n, m = view.shape[dim], new.shape[dim]
    if reserve is not None and reserve.dim == dim and new.dtype == view.dtype and reserve.is_tip(view) \
            and reserve.end + m <= reserve.capacity:
        reserve.buffer.narrow(dim, reserve.end, m).copy_(new)
        reserve.end += m
        return reserve.buffer.narrow(dim, reserve.end - n - m, n + m), reserve
    total = n + m
    shape = list(view.shape)
    shape[dim] = total + max(math.ceil(total * SPARE), MIN_SPARE)
    buffer = torch.empty(shape, dtype=torch.promote_types(view.dtype, new.dtype), device=view.device)
    buffer.narrow(dim, 0, n).copy_(view)
    buffer.narrow(dim, n, m).copy_(new)
    return buffer.narrow(dim, 0, total), Reserve(buffer, total, dim)
