"""The resolution schedule: chunk size g_t, offset ω_t and causal shift s_t of every iteration.

spiralformer.txt §2.3.1. Iteration t with resolution r_t groups positions into chunks of
g_t = ⌊1/r_t⌋ tokens, shifted by an offset ω_t ∈ {0, .., g_t − 1}:

    π_t(i) = ⌊(i + ω_t) / g_t⌋,   ρ_t(i) = (i + ω_t) − g_t π_t(i)          # Eq. (12)

so chunk j holds positions max(0, j g_t − ω_t) .. (j + 1) g_t − ω_t − 1 (with ω_t > 0 the
first chunk has only g_t − ω_t tokens). The update is right-shifted by s_t (Eq. 22);
s_t = g_t − 1 is the single-token-overlap regime, s_t ≥ g_t the parallel (no-overlap)
regime, s_t ≤ g_t − 2 is not causal (Prop. 1) and refused at config load.

Which chunks exist (a choice the paper leaves open). Eq. (13) keeps L_t = ⌊L/g_t⌋ chunks
and drops the incomplete last one. With ω_t > 0 that rule can drop a chunk that is already
complete (L = 12, g = 8, ω = 4: chunk 1 = positions 4..11 is complete, ⌊12/8⌋ = 1), so the
output at position 11 would depend on how many tokens follow it, and prefill + decoding
(Algorithm 2 runs chunk 1 at its last token, i = 11) would differ from the full forward.
We keep exactly the complete chunks, L_t = ⌊(L + ω_t)/g_t⌋, which is Eq. (13) for
ω_t = 0 and what Algorithm 2 computes for every ω_t.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Optional, Sequence


@dataclasses.dataclass(frozen=True)
class IterationResolution:
    """chunk: g_t = ⌊1/r_t⌋; offset: ω_t; shift: s_t."""

    chunk: int
    offset: int
    shift: int

    @property
    def identity(self) -> bool:
        """Full resolution with no shift: S↓, S↑ and the shift are all the identity."""
        return self.chunk == 1 and self.offset == 0 and self.shift == 0

    @property
    def parallel(self) -> bool:
        """s_t ≥ g_t (Prop. 1(3), Appendix E): a position's update never reads its own chunk,
        so a chunk's coarse work is finished before any token that consumes it arrives."""
        return self.shift >= self.chunk

    @property
    def gain(self) -> float:
        """λ_t = √g_t (§2.3.3)."""
        return self.chunk**0.5

    def chunk_index(self, i):
        """π_t(i), Eq. (12); works on ints and integer tensors."""
        return (i + self.offset) // self.chunk

    def in_chunk(self, i):
        """ρ_t(i), Eq. (12)."""
        return (i + self.offset) % self.chunk

    def complete_chunks(self, length: int) -> int:
        """L_t: chunks whose every position is among the first ``length`` (see module doc)."""
        return (length + self.offset) // self.chunk

    def chunk_start(self, j: int) -> int:
        """First position of chunk j."""
        return max(0, j * self.chunk - self.offset)

    def trigger(self, j: int) -> int:
        """Last position of chunk j: where decoding runs the coarse core for it (ρ = g − 1)."""
        return (j + 1) * self.chunk - self.offset - 1

    def closing(self, i: int) -> Optional[int]:
        """What position i does at the chunk level: None if it is no chunk's last position,
        else the empty slots before the chunk it completes (ω for chunk 0, 0 for the others).
        Periodic in i with period g_t apart from chunk 0, so a decoding step that branches on
        it takes at most three forms per iteration."""
        if (i + self.offset + 1) % self.chunk:
            return None
        return self.offset if i + self.offset + 1 == self.chunk else 0

    def source_chunk(self, i: int) -> Optional[int]:
        """Chunk whose latent the shifted update of position i reads, Eq. (22); None if i < s."""
        return None if i < self.shift else self.chunk_index(i - self.shift)


def iteration_resolutions(
    resolutions: Sequence[Fraction], offsets: Optional[Sequence[int]], shifts: Optional[Sequence[int]]
) -> tuple[IterationResolution, ...]:
    """Resolve defaults: ω_t = ⌊g_t/2⌋ (§2.4), s_t = g_t − 1 (§2.3.4)."""
    chunks = [int(1 // r) for r in resolutions]  # g_t = ⌊1/r_t⌋
    offsets = [g // 2 for g in chunks] if offsets is None else list(offsets)
    shifts = [g - 1 for g in chunks] if shifts is None else list(shifts)
    return tuple(IterationResolution(g, w, s) for g, w, s in zip(chunks, offsets, shifts))


def core_lengths(schedule: Sequence[IterationResolution], length: int) -> list[int]:
    """Positions the core processes at each iteration of a length-L training forward (L_t);
    the core's token passes per iteration are L_t times its block count."""
    return [length if it.identity else it.complete_chunks(length) for it in schedule]
