"""One multi-resolution iteration around the shared core (spiralformer.txt §2.2, Alg. 1-2).

    z = S↓(h^(t))  ->  ẑ = f_core(z) at resolution r_t  ->  ũ = shift(S↑(ẑ), s_t)  ->  U(ũ, ...)

The loop driver (``LoopLM._core``) calls :meth:`MultiResolution.down`, runs the core
blocks on the compressed sequence with the compressed :class:`MixerContext`, and hands
the result to :meth:`MultiResolution.up`; the topology then folds ũ into the state.

Training and decoding are one code path, chunk-triggered as in Algorithm 2: a forward over
new positions P .. P+T−1 down-scales only the chunks that complete among them (with the
buffered start of the current chunk from the cache), runs the core once on those new
chunks against the core's compressed-resolution mixer states, and gives every new
position the latent of chunk π(i − s) — already cached unless it completed in this
forward. A full forward is the case P = 0; a decoding step that completes no chunk runs
no coarse core at all.

Positions. The compressed sequence is just a shorter sequence for the mixer: chunk j sits
at position j (its chunk index) for rotary embeddings, in training and in decoding alike,
so the shared core sees relative distances in chunks at every resolution.

Static cache. Against a :class:`~looplm.cache.StaticLoopCache` the chunk state is a
:class:`StaticChunkState` of preallocated buffers written in place, and a single new
position P is handled with device indices only (its row ``ctx.slots``): h_P goes to slot
ρ(P) of the chunk buffer, and ũ_P is row P of the buffer of shifted updates. Whether P
completes a chunk (so the coarse core runs) is a host-side fact the cache keeps per
iteration (``StaticChunkState.closing``, from its host length), so a captured step takes one
graph per set of completing iterations and never reads P on the host. Several new
positions against a static cache (an eager chunked forward) use host indices.

Padding. Chunks are cut by position index; with left padding they would be cut
differently per row and complete at different steps, so left-padded batches are refused
for multi-resolution iterations (ValueError). Prompts of different lengths can be
generated one row at a time.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from looplm.accounting.cost import Call, Step
from looplm.layout import Layout
from looplm.mixers.base import MixerContext
from looplm.ops.backend import use_triton
from looplm.resolution.config import ResolutionConfig
from looplm.resolution.downscale import build_down, chunk_grid
from looplm.resolution.schedule import IterationResolution, iteration_resolutions
from looplm.resolution.state import ChunkState, StaticChunkState
from looplm.resolution.upscale import build_up

if TYPE_CHECKING:
    from looplm.cache import LoopCache
    from looplm.modules.rotary import Rotary


@dataclasses.dataclass
class Compressed:
    """What S↓ hands the core, and what S↑ needs back.

    z: [B, n, d] latents of the n chunks that complete in this forward. ctx: the mixer
    context at the compressed resolution (positions = chunk indices). first: index of the
    first of them. tokens: [B, k + T, d] the buffered positions of the current chunk and
    the new ones, starting at position ``tokens_start``. start: P, the first new position.
    """

    z: torch.Tensor
    ctx: MixerContext
    first: int
    tokens: torch.Tensor
    tokens_start: int
    start: int
    previous: Optional[ChunkState]


@dataclasses.dataclass
class StaticCompressed:
    """:class:`Compressed` against a static cache. z, ctx: as there (ctx's slots are the
    completing chunks' rows in the core's compressed states). state: the iteration's buffers.
    slots: [T] the new positions' rows. first: the first completing chunk where the host
    knows it (several positions, or chunk 0), None where only the device does (a single
    position completing a later chunk) or none completes."""

    z: torch.Tensor
    ctx: MixerContext
    state: StaticChunkState
    slots: torch.Tensor
    first: Optional[int]


class MultiResolution(nn.Module):
    """Per-iteration S↓ (mean / self-aggregation) and S↑ (uniform / router) operators and the
    schedule (g_t, ω_t, s_t). Iterations at full resolution without shift are the identity
    and own no modules. ``down[str(t)]`` holds A^(t), ``up[str(t)]`` holds B^(t). On CUDA
    (``model.resolution.kernel``) S↓ and S↑ with the shift run as Triton kernels
    (:mod:`looplm.ops.resolution_triton`)."""

    def __init__(self, cfg: ResolutionConfig, resolutions: Sequence[float], d_model: int):
        """cfg: ``model.resolution``; resolutions: r_t per iteration (the layout's);
        d_model: the state width."""
        super().__init__()
        self.schedule: tuple[IterationResolution, ...] = iteration_resolutions(resolutions, cfg.offsets, cfg.shifts)
        active = [t for t, it in enumerate(self.schedule) if not it.identity]
        self.down_ops = nn.ModuleDict({str(t): build_down(cfg.down, d_model, self.schedule[t].chunk) for t in active})
        self.up_ops = nn.ModuleDict({str(t): build_up(cfg.up, d_model, self.schedule[t].chunk) for t in active})
        self.kernel = cfg.kernel

    def _fused(self, x: torch.Tensor, chunk: int) -> bool:
        """Whether this iteration's S↓ and S↑ run as Triton kernels on ``x`` [..., d]: chunks of
        g > 1 (at g = 1 both are views), on CUDA under ``kernel: auto``, with a [g, d] tile
        that fits a program."""
        if chunk == 1 or not use_triton(x, self.kernel):
            return False
        from looplm.ops.resolution_triton import fits

        return fits(chunk, x.shape[-1])

    def extra_repr(self) -> str:
        return "schedule=[" + ", ".join(f"(g={i.chunk}, ω={i.offset}, s={i.shift})" for i in self.schedule) + "]"

    def identity(self, t: int) -> bool:
        return self.schedule[t].identity

    def down(
        self, t: int, h: torch.Tensor, ctx: MixerContext, rotary: "Rotary", cache: Optional["LoopCache"]
    ) -> Compressed:
        """S↓ of the chunks completed by the new positions. h: [B, T, d], h^(t) at the new
        positions P = ctx.past .. P + T − 1.

        The chunks are a reshape of the sequence (:func:`chunk_grid`): one pad when chunk 0
        starts before position 0 (ω > 0), one concatenation only when the cache holds the
        start of the current chunk. The core's rotary table is this forward's own (a slice)
        whenever the chunk indices are among its positions, as in every full forward."""
        it = self.schedule[t]
        if ctx.padded:
            raise ValueError(
                f"left-padded batches are not supported by multi-resolution iteration {t} (r = 1/{it.chunk}): "
                "chunks are cut by position and would differ per row; run prompts of different lengths separately"
            )
        previous = cache.chunk(t) if cache is not None else None
        if isinstance(previous, StaticChunkState):
            return self._down_static(t, h, ctx, rotary, cache, previous)
        B, T, d = h.shape
        P = ctx.past
        if P is None:  # a static cache's context
            raise ValueError(f"the static cache holds no chunk state for multi-resolution iteration {t}: "
                             "make it with LoopCache.static from a cache a prefill forward filled")
        if previous is None and P > 0:
            raise ValueError(f"the cache holds {P} positions but no chunk state for iteration {t}")
        g, done = it.chunk, it.complete_chunks(P)
        total = it.complete_chunks(P + T)
        n = total - done
        pending = previous.pending if previous is not None else None
        if pending is not None and pending.shape[1]:
            tokens = torch.cat([pending, h], dim=1)  # the buffered start of the current chunk, then h
        else:
            tokens = h
        tokens_start = it.chunk_start(done)  # position of tokens[:, 0]
        lead = tokens_start - (done * g - it.offset)  # empty slots before position 0 (chunk 0 with ω > 0)
        down = self.down_ops[str(t)]
        if n and self._fused(tokens, g):  # one kernel reading the chunks in place
            z = down.fused(tokens, lead, n, g)  # Eq. (16) or (17-18): [B, n, d]
        elif n:
            x = chunk_grid(tokens, lead, n, g)  # [B, n, g, d]: chunk done + k in row k
            z = down(x, lead)  # Eq. (16) or (17-18): [B, n, d]
        else:  # no chunk completes: the core does not run
            z = h[:, :0]
        zctx = dataclasses.replace(
            ctx,
            rope=_chunk_rope(ctx, rotary, done, total, h.dtype),
            valid=ctx.valid[:, :total],  # unpadded (refused above), so all True
            past=done,
            padded=False,
            _masks={},
        )
        return Compressed(z, zctx, done, tokens, tokens_start, P, previous)

    def _down_static(self, t: int, h: torch.Tensor, ctx: MixerContext, rotary: "Rotary", cache: "LoopCache",
                     state: StaticChunkState) -> StaticCompressed:
        """:meth:`down` against a static cache: the new positions enter the chunk buffer in
        place; the chunks they complete are down-scaled and marked valid for the core."""
        it = self.schedule[t]
        g, w = it.chunk, it.offset
        B, T = h.shape[:2]
        if torch.compiler.is_compiling():
            if T != 1:
                raise ValueError(f"a captured decoding step of multi-resolution iteration {t} takes one new "
                                 f"position at a time, not {T}")
            lead = state.closing  # set on the host for this position: never P itself
        else:
            start = cache.get_seq_length() - T  # P: the static cache has counted the new positions
            lead = it.closing(start) if T == 1 else None
        if T == 1:  # device indices: the same graph for every position of one closing
            grid_slot = ctx.slots + w if w else ctx.slots  # [1]: g·π(P) + ρ(P), Eq. (12)
            state.pending.index_copy_(1, grid_slot % g, h)  # B^(t)[ρ(P)] ← h_P (Algorithm 2)
            if lead is None:  # no chunk completes: the core does not run
                return StaticCompressed(h[:, :0], ctx, state, ctx.slots, None)
            x = state.pending[:, None]  # [B, 1, g, d]
            if lead:  # chunk 0: its ω empty slots hold zeros (as chunk_grid pads them)
                x = F.pad(x[:, :, lead:], (0, 0, lead, 0))
            chunks, first = grid_slot // g, 0 if lead else None  # [1]: π(P), the chunk P completes
        else:  # several positions (eager): host indices
            done, total = it.complete_chunks(start), it.complete_chunks(start + T)
            tokens_start = it.chunk_start(done)
            first_slot, buffered = it.in_chunk(tokens_start), start - tokens_start
            tokens = torch.cat([state.pending[:, first_slot : first_slot + buffered], h], dim=1) if buffered else h
            kept = it.chunk_start(total) - tokens_start  # tokens[:, kept:] start the chunk left incomplete
            rest = it.in_chunk(it.chunk_start(total))
            state.pending[:, rest : rest + tokens.shape[1] - kept] = tokens[:, kept:]
            if total == done:
                return StaticCompressed(h[:, :0], ctx, state, ctx.slots, None)
            lead = tokens_start - (done * g - w)
            x = chunk_grid(tokens, lead, total - done, g)  # [B, n, g, d]
            chunks, first = torch.arange(done, total, device=h.device), done
        z = self.down_ops[str(t)](x, lead)  # Eq. (16) or (17-18): [B, n, d]
        state.valid.index_fill_(1, chunks, True)
        zctx = dataclasses.replace(ctx, rope=rotary(chunks.expand(B, -1), h.dtype), valid=state.valid, past=None,
                                   padded=False, slots=chunks, _masks={})
        return StaticCompressed(z, zctx, state, ctx.slots, first)

    def _up_static(self, t: int, step: StaticCompressed, z_hat: torch.Tensor) -> torch.Tensor:
        """:meth:`up` against a static cache: S↑ of the completed chunks is written to the
        rows of the positions that read them (Eq. 19-22), then the new positions read their
        own rows."""
        state = step.state
        if z_hat.shape[1]:
            B, n, d = z_hat.shape
            grid = self.up_ops[str(t)](z_hat).reshape(B, n * self.schedule[t].chunk, d)  # Eq. (19-21)
            if step.first is not None:  # host indices
                state.write_updates(step.first, grid)
            else:  # the chunk completed at P: rows P + s + 1 − g .. P + s (Eq. 22)
                state.updates.index_copy_(1, step.slots + state.rows, grid)
        return state.updates.index_select(1, step.slots)  # ũ at the new positions (rows < s stay 0)

    def up(self, t: int, step: Compressed, z_hat: torch.Tensor, cache: Optional["LoopCache"]) -> torch.Tensor:
        """ũ = shift(S↑(ẑ), s_t) at the new positions: [B, T, d]. z_hat: [B, n, d], the core's
        output for the chunks ``step`` down-scaled. Updates the cache's chunk state.

        Position i reads slot k = i − s + ω of the chunk grid (chunk π(i − s) = k // g, slot
        ρ(i − s) = k mod g, Eq. 12 and 22), so S↑ of the chunks read, reshaped to a sequence
        from the first slot read, is ũ up to one pad: zeros for i < s, the rest cropped."""
        if isinstance(step, StaticCompressed):
            return self._up_static(t, step, z_hat)
        it = self.schedule[t]
        g, s = it.chunk, it.shift
        B, _, d = step.tokens.shape
        P = step.start
        T = step.tokens.shape[1] - (P - step.tokens_start)
        old = step.previous.latents if step.previous is not None else None
        if old is None or old.shape[1] == 0:
            latents = z_hat
        elif z_hat.shape[1] == 0:
            latents = old
        else:
            latents = torch.cat([old, z_hat], dim=1)  # [B, N, d]: ẑ of every completed chunk
        front = min(T, max(0, s - P))  # new positions i < s: ũ_i = 0, Eq. (22)
        if front == T:  # no new position reads a latent yet
            u = z_hat.new_zeros(B, T, d)
        else:
            first = max(P, s) - s + it.offset  # grid slot of the first position that reads one
            j0 = first // g  # the first chunk read; the last is π(P + T − 1 − s) < N (Prop. 1)
            read = latents[:, j0:] if j0 else latents  # [B, m, d]: in decoding only the latest chunks
            m = read.shape[1]
            skip = first - j0 * g  # slots before ``first``: read by no new position (or empty, k < ω)
            up = self.up_ops[str(t)]
            if self._fused(read, g):  # one kernel writing the shifted rows
                u = up.fused(read, front, skip, T)  # Eq. (19-22)
            else:
                grid = up(read).reshape(B, m * g, d)  # Eq. (19-21): slot j0·g + k at row k
                rows = grid[:, skip:] if skip else grid
                right = T - front - (m * g - skip)  # <= 0: crop the slots after the last new position
                u = F.pad(rows, (0, 0, front, right)) if front or right else rows  # Eq. (22)
        if cache is not None:
            N, end = latents.shape[1], P + T
            keep = it.chunk_start(N) - step.tokens_start  # the current chunk's buffered positions
            triggers = list(step.previous.triggers) if step.previous is not None else []
            triggers += [it.trigger(j) for j in range(step.first, N)]
            cache.set_chunk(t, ChunkState(it, step.tokens[:, keep:], latents, end, triggers, self.up_ops[str(t)]))
        return u

    def pass_calls(self, t: int, call: Call, core: Callable[[Call], list[Step]]) -> list[Step]:
        """The calls of iteration t's core update (``call``: the full forward at iteration t;
        ``core(c)``: the core stack's calls on c): at full resolution the core alone; else S↓
        on the n·g_t tokens of the n = L_t complete chunks, the core on n positions, S↑ on the
        n latents writing n·g_t slots (the causal shift, Eq. 22, a pad: no arithmetic)."""
        if self.identity(t):
            return core(call)
        it = self.schedule[t]
        n, g = it.complete_chunks(call.tokens), it.chunk
        down = Call(call.batch, n * g, n * g, phase="down", iteration=t, width=call.width)
        up = Call(call.batch, n, n, phase="up", iteration=t, width=call.width)
        return [Step("resolution", f"resolution.down.{t}", self.down_ops[str(t)], down),
                *core(Call(call.batch, n, n, iteration=t, width=call.width)),
                Step("resolution", f"resolution.up.{t}", self.up_ops[str(t)], up)]


def _chunk_rope(ctx: MixerContext, rotary: "Rotary", done: int, total: int, dtype: torch.dtype):
    """(cos, sin) [B, n, R] for chunks done .. total − 1 at positions done .. total − 1 (the
    chunk index). ctx.rope holds positions ctx.past .. ctx.past + T − 1 of an unpadded
    sequence; when the chunk indices lie among them (every forward from position 0) the
    table is a slice of it, the same values rotary() would compute."""
    cos, sin = ctx.rope
    P, T = ctx.past, cos.shape[1]
    if (P <= done and total <= P + T and cos.dtype == dtype) or done == total:
        a, b = (done - P, total - P) if done != total else (0, 0)
        return cos[:, a:b], sin[:, a:b]
    positions = torch.arange(done, total, device=cos.device).expand(cos.shape[0], total - done)
    return rotary(positions, dtype)


def build_resolution(cfg: ResolutionConfig, layout: Layout, d_model: int) -> Optional[MultiResolution]:
    """The resolution axis of ``layout``'s loop, or None without a loop or when every
    iteration is the identity."""
    if not layout.is_looped:
        return None
    schedule = iteration_resolutions(layout.resolutions, cfg.offsets, cfg.shifts)
    return None if all(it.identity for it in schedule) else MultiResolution(cfg, layout.resolutions, d_model)
