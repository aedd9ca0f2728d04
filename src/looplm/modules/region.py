"""One block pass of a captured decoding step as a nested compile region.

``torch.compile`` traces a decoding step by running its Python: the loop over iterations
and blocks unrolls, and every block pass (100 for LT2's 25R4) is traced, optimised and
code-generated again, though all passes of a block, and all blocks of one kind, compute
the same function of their inputs. :func:`static_block_pass` calls a block through
:func:`torch.compiler.nested_compile_region` instead: Dynamo traces the pass once and
stamps out the same subgraph for every later pass whose inputs match (the parameters of
another block of the same structure, another iteration's cache buffers), and the backend
(AOTAutograd, inductor) compiles each distinct subgraph once. The backend's work then
follows the number of distinct block kinds, not the loop's depth; Dynamo still walks every
pass (flattening its inputs), so tracing time keeps growing with depth. Outside
``torch.compile`` the region is the plain call.

A region's inputs are tensors and constants only, none aliasing another, and its one
output is the block's output: the pass builds its own :class:`MixerContext` from the
step's context tensors (its masks are made inside it, never stored on the step's
context) and writes the mixer's new state into the cache's buffers in place (a static
cache registers its states' classes as pytree nodes, :func:`looplm.cache.register_pytree`,
so the region sees their tensors). Same operators as the unrolled step, so the same numbers.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from looplm.cache import copy_into
from looplm.mixers.base import MixerContext, MixerState
from looplm.modules.block import Block


#: whether this torch has nested compile regions (torch >= 2.8); without them every pass is traced
AVAILABLE = hasattr(torch.compiler, "nested_compile_region")


def _region(fn):
    """``torch.compiler.nested_compile_region`` with room for every block kind and loop-level
    variant of a model (torch's default stops reusing after 8 entries per function)."""
    if not AVAILABLE:
        return fn
    if "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters:
        return torch.compiler.nested_compile_region(fn, max_reuse_entries=REUSE_ENTRIES)
    return torch.compiler.nested_compile_region(fn)


#: distinct traced passes a region keeps for reuse (block kinds × loop-level variants)
REUSE_ENTRIES = 64


@_region
def _block_pass(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, valid: torch.Tensor,
                slots: torch.Tensor, padded: bool, state: MixerState, variant: int) -> torch.Tensor:
    """x [B, T, d] -> the block's output [B, T, d]; ``state``'s buffers are written in place."""
    ctx = MixerContext(rope=(cos, sin), valid=valid, past=None, padded=padded, slots=slots)
    out, new = block(x, ctx, state, iteration=variant)
    if new is not None and new is not state:  # a fixed-size state's new values go into the cache's tensors
        copy_into(state, new)
    return out


def takes_region(block: Block, ctx: MixerContext, state: Optional[MixerState]) -> bool:
    """Whether this pass runs as a region: where torch has them, while ``torch.compile``
    traces (eagerly a region is the plain call, and the step's context shares its masks
    across passes), on a static cache's step (``ctx.slots``) with a state to write, in
    inference, and nothing the pass must hand back on the step's context (recorded
    attentions, Mixture-of-Recursions' first-step keys)."""
    return (AVAILABLE and torch.compiler.is_compiling() and ctx.slots is not None and state is not None
            and not block.training and ctx.attentions is None and ctx.first_step_kv is None)


def static_block_pass(block: Block, x: torch.Tensor, ctx: MixerContext, state: MixerState,
                      iteration: int) -> torch.Tensor:
    """``block(x, ctx, state, iteration)`` on a static cache as one region (see the module);
    returns the output [B, T, d], ``state`` updated in place. Check :func:`takes_region` first."""
    cos, sin = ctx.unaliased_rope()
    return _block_pass(block, x, cos, sin, ctx.valid, ctx.slots, ctx.padded, state, block.variant(iteration))
