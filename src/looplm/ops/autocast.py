"""Hand-written ops that run their own precision: the dtype autocast would give their
products, and a context that keeps autocast from casting inside them."""

from __future__ import annotations

import contextlib

import torch


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast runs a product of ``x`` in (``x``'s own outside autocast)."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device`` (a device without autocast, e.g. meta, needs nothing)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
