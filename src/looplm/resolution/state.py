"""Decoding state of one multi-resolution iteration (spiralformer.txt Algorithm 2): the
growing :class:`ChunkState` and its preallocated form :class:`StaticChunkState`."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from looplm.resolution.schedule import IterationResolution


@dataclasses.dataclass
class ChunkState:
    """Everything iteration t needs from earlier positions besides the core's own mixer
    states (which the cache keeps under (block, t) at the compressed resolution).

    pending: [B, k, d] the chunk buffer B^(t): h^(t) of the k positions of the chunk that is
    not complete yet. latents: [B, N, d] ẑ^(t) of every completed chunk, in chunk order
    (Algorithm 2 keeps only the last one, which suffices for s = g − 1; the parallel
    regime s ≥ g reads older ones, and crop needs them). length: positions seen.
    triggers: the positions at which the coarse core ran, one per chunk (the last position
    of the chunk, ρ = g − 1; Appendix D). up: the iteration's S↑ (ẑ [B, m, d] -> [B, m, g, d]),
    which :meth:`static` needs to lay out the updates of the completed chunks.
    """

    resolution: IterationResolution
    pending: torch.Tensor
    latents: torch.Tensor
    length: int
    triggers: list[int] = dataclasses.field(default_factory=list)
    up: Optional[Callable[[torch.Tensor], torch.Tensor]] = dataclasses.field(default=None, repr=False, compare=False)

    def crop(self, length: int) -> "ChunkState":
        """The state after the first ``length`` positions. Only positions of the current chunk
        can be forgotten: the buffer of an earlier chunk is gone once that chunk completed."""
        if length >= self.length:
            return self
        it = self.resolution
        start = check_crop(it, self.length, length)
        held = it.chunk_start(it.complete_chunks(self.length))
        pending = self.pending[:, : max(0, length - start)] if start >= held else self.pending[:, :0]
        return ChunkState(it, pending, self.latents[:, : it.complete_chunks(length)], length,
                          [p for p in self.triggers if p < length], self.up)

    def select(self, index: torch.Tensor) -> "ChunkState":
        return ChunkState(self.resolution, self.pending[index], self.latents[index], self.length, list(self.triggers),
                          self.up)

    def static(self, capacity: int) -> "StaticChunkState":
        """This state in buffers for ``capacity`` positions (:class:`StaticChunkState`): the
        pending positions at their slots, the shifted updates ũ of every completed chunk at
        the positions that read them, the completed chunks marked valid. TypeError before
        the first chunk completed (the core's states at this resolution do not exist yet)."""
        it = self.resolution
        g, s = it.chunk, it.shift
        B, _, d = self.pending.shape
        done = self.latents.shape[1]
        if not done:
            raise TypeError(f"its first chunk (g={g}, ω={it.offset}) completes at position {it.trigger(0)}, after "
                            f"these {self.length} positions, so its coarse core has no state to preallocate yet; "
                            f"prefill at least {it.trigger(0) + 1} positions")
        state = StaticChunkState(
            it,
            pending=self.pending.new_zeros(B, g, d),
            updates=self.latents.new_zeros(B, capacity + s, d),
            valid=torch.zeros(B, it.complete_chunks(capacity), dtype=torch.bool, device=self.pending.device),
            rows=torch.arange(s + 1 - g, s + 1, device=self.pending.device),
        )
        state.pending[:, : self.pending.shape[1]] = self.pending  # a chunk after chunk 0 starts at slot 0
        state.write_updates(0, self.up(self.latents).reshape(B, done * g, d))
        state.valid[:, :done] = True
        return state


def check_crop(it: IterationResolution, held_length: int, length: int) -> int:
    """Refuse a crop to ``length`` positions that needs the buffer of a chunk that already
    completed (ValueError); return the first position of the chunk ``length`` ends in."""
    start = it.chunk_start(it.complete_chunks(length))  # first position the cropped buffer must hold
    held = it.chunk_start(it.complete_chunks(held_length))
    if length > start and start < held:
        raise ValueError(
            f"cannot crop a multi-resolution cache (g={it.chunk}, ω={it.offset}) to {length} positions: "
            f"the buffer of the chunk starting at {start} was released when it completed; "
            f"crop to {held} or more, or to a chunk boundary"
        )
    return start


@dataclasses.dataclass
class StaticChunkState:
    """:class:`ChunkState` in buffers preallocated for a static cache's C positions, written
    in place: a captured decoding step reads and writes the same storage every time.

    pending: [B, g, d] the chunk buffer B^(t), position i at slot ρ(i) (chunk 0's first ω
    slots stay empty). updates: [B, C + s, d] the shifted update ũ_i of Eq. (22) at row i,
    written for the g positions that read a chunk when the chunk completes (rows i < s are
    never written: ũ_i = 0); a step reads its own row. valid: [B, L_C] the completed chunks,
    the key validity of the core's compressed-resolution static states. rows: [g] the rows a
    chunk completing at position P writes, relative to P: P + s + 1 − g .. P + s.

    closing: what the next single position P (the cache's host length) does at this
    iteration: None if it completes no chunk, else the empty ``lead`` slots of the chunk it
    completes (ω for chunk 0, else 0). Set on the host by the cache whenever its length
    changes; a captured step branches on it (one graph per distinct set of closings), never
    on P itself.
    """

    resolution: IterationResolution
    pending: torch.Tensor
    updates: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor
    closing: Optional[int] = None

    def write_updates(self, first_chunk: int, grid: torch.Tensor) -> None:
        """Write S↑ of chunks ``first_chunk`` .. (``grid`` [B, m·g, d], slot j·g + ρ at row
        (j − first_chunk)·g + ρ) at the rows of the positions that read them, with host
        indices: slot k is read by position k − ω + s (Eq. 12, 22); the ω empty slots of
        chunk 0 by none."""
        it = self.resolution
        skip = it.offset if first_chunk == 0 else 0
        start = first_chunk * it.chunk - it.offset + it.shift + skip
        self.updates[:, start : start + grid.shape[1] - skip] = grid[:, skip:]

    def crop(self, old_length: int, length: int) -> None:
        """Forget positions ``length`` .. ``old_length`` − 1: the chunks completed among them
        become invalid (their updates rows and slots are rewritten before they are read)."""
        check_crop(self.resolution, old_length, length)
        self.valid[:, self.resolution.complete_chunks(length) :] = False

    def select(self, index: torch.Tensor) -> "StaticChunkState":
        """Reorder the rows in place (beam search keeps the batch size); a smaller batch gets
        new buffers."""
        if index.shape[0] != self.pending.shape[0]:
            return dataclasses.replace(self, pending=self.pending[index], updates=self.updates[index],
                                       valid=self.valid[index])
        for buffer in (self.pending, self.updates, self.valid):
            buffer.copy_(buffer[index])
        return self
