"""Whether the running code is an activation-checkpointing recomputation.

Activation checkpointing (:mod:`looplm.train.activation_checkpointing`) runs parts of a training
forward a second time, inside the backward, to rebuild the tensors autograd needs. What a
forward does besides computing tensors must happen once per forward, not once more per
recomputation: the auxiliary losses a mixer adds (:meth:`MixerContext.add_loss`, e.g. the
DSA index loss, already in the loss being differentiated), attention records and SGT's
entropy meter. Those places ask :func:`recomputing` and skip their side effect; the
recomputed values only feed the gradients through autograd's saved tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("looplm_recomputing", default=False)


def recomputing() -> bool:
    """True inside an activation-checkpointing recomputation (a backward). Never while
    torch.compile traces: a compiled graph's recomputation is the partitioner's, which
    does not run this Python again (and Dynamo cannot trace a ContextVar)."""
    if torch.compiler.is_compiling():
        return False
    return _RECOMPUTING.get()


@contextlib.contextmanager
def recomputation() -> Iterator[None]:
    """Mark the code it wraps as a recomputation (the checkpoint's recompute context)."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)
