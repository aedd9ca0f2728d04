"""Activation checkpointing, applied by the trainer from outside the model.

``train.activation_checkpointing`` trades compute for memory: the forward keeps only the
inputs of each checkpointed region, and the backward runs the region again to rebuild
the activations autograd needs (non-reentrant ``torch.utils.checkpoint``: about one extra
forward of the region per step).

- ``block``: every block (prelude, core, coda) is a region. The forward keeps one block
  input per block evaluation, so a looped core still keeps ``core`` inputs per pass; the
  backward holds one block's activations at a time.
- ``iteration``: every core pass (the core stack once, i.e. one loop iteration for one
  pass per macro step) is a region; prelude and coda blocks as under ``block``. The loop
  keeps only its states h^(t), one per pass however deep the core: what lets long loops
  fit. The backward holds one pass's activations (the whole core stack) at a time.

The model names its regions through one seam, ``LoopLM.recompute`` (a plain attribute:
module structure, parameter names and state dict unchanged); this module decides which
run under ``torch.utils.checkpoint`` (non-reentrant). Not with ``train.compile`` yet
(TrainConfig refuses the pair): under Dynamo the recompute context must be dispatch modes
and Python side effects inside a region break the graph. Both
only act in forwards that record a graph: evaluation and generation run under
``no_grad`` (nothing is saved, nothing recomputed), and the seam is skipped with a
decoding cache. Side effects of a recomputation are suppressed through
:mod:`looplm.recompute` (auxiliary losses such as the DSA index loss are counted once,
attention records and SGT's entropy meter record once per forward). RNG: the regions
save and restore the RNG state (``preserve_rng_state``), though no looplm module draws
random numbers in its forward (no dropout). Recomputation is exact: losses and gradients
equal those without checkpointing.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from looplm.config_base import ConfigError
from looplm.model import LoopLM
from looplm.recompute import recomputation

#: The values of ``train.activation_checkpointing``.
MODES = ("none", "block", "iteration")


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(forward context, recompute context) of one region: the recomputation marks itself."""
    return contextlib.nullcontext(), recomputation()


def _regions(mode: str) -> Callable[[str, Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]:
    """``LoopLM.recompute`` for ``mode``: the regions it names run as checkpointed regions
    when a graph is being recorded, the others directly."""
    parts = {"block": ("prelude", "core", "coda"), "iteration": ("prelude", "pass", "coda")}[mode]

    def recompute(part: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if part not in parts or not torch.is_grad_enabled():
            return fn(x)
        return checkpoint(fn, x, use_reentrant=False, context_fn=_contexts)

    return recompute


def apply_activation_checkpointing(model: LoopLM, mode: str) -> None:
    """Apply ``mode`` (one of :data:`MODES`) to ``model`` in place; call it once, before DDP
    and compile (:meth:`looplm.train.Trainer._wrap`)."""
    if mode == "none":
        return
    if mode not in ("block", "iteration"):
        raise ConfigError("train.activation_checkpointing", mode, f"one of {', '.join(MODES)}")
    if mode == "iteration" and model.topology is None:
        raise ConfigError("train.activation_checkpointing", mode,
                          f"none or block: layout {model.cfg.layout!r} has no loop to checkpoint per iteration")
    model.recompute = _regions(mode)
