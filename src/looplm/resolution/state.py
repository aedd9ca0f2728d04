"""Decoding state of one multi-resolution iteration (spiralformer.txt Algorithm 2)."""

from __future__ import annotations

import dataclasses

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
    of the chunk, ρ = g − 1; Appendix D).
    """

    resolution: IterationResolution
    pending: torch.Tensor
    latents: torch.Tensor
    length: int
    triggers: list[int] = dataclasses.field(default_factory=list)

    def crop(self, length: int) -> "ChunkState":
        """The state after the first ``length`` positions. Only positions of the current chunk
        can be forgotten: the buffer of an earlier chunk is gone once that chunk completed."""
        if length >= self.length:
            return self
        it = self.resolution
        chunks = it.complete_chunks(length)
        start = it.chunk_start(chunks)  # first position the cropped buffer must hold
        held = it.chunk_start(it.complete_chunks(self.length))
        if length > start and start < held:
            raise ValueError(
                f"cannot crop a multi-resolution cache (g={it.chunk}, ω={it.offset}) to {length} positions: "
                f"the buffer of the chunk starting at {start} was released when it completed; "
                f"crop to {held} or more, or to a chunk boundary"
            )
        pending = self.pending[:, : max(0, length - start)] if start >= held else self.pending[:, :0]
        return ChunkState(it, pending, self.latents[:, :chunks], length, [p for p in self.triggers if p < length])

    def select(self, index: torch.Tensor) -> "ChunkState":
        return ChunkState(self.resolution, self.pending[index], self.latents[index], self.length, list(self.triggers))
