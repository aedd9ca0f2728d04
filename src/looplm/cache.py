"""Decoding cache of a looped model.

Under weight sharing the same mixer runs once per iteration and sees different inputs
each time, so states are keyed by ``(block, iteration)``, never by layer alone. Each
state is the mixer's own typed object (keys/values, a window of them, a recurrent
matrix, ...; see ``looplm.mixers``). The cache also keeps which positions are real tokens
(left-padded batches) and the next position id of every row.

State-passing topologies (``looplm.topology``) act on each position independently, so
the carrier of a past position (an anchor, the MeSH buffer) is never read when later
tokens are decoded; it is recomputed for the new positions only and need not be cached.

Multi-resolution iterations (``looplm.resolution``) run the core on chunk latents: their
core states (block, t) hold compressed positions (one per completed chunk), and
``chunks[t]`` holds the chunk buffer and the finalised latents (Algorithm 2 of
spiralformer.txt).
"""

from __future__ import annotations

from typing import Optional

import torch

from looplm.mixers.base import MixerState
from looplm.resolution.state import ChunkState


class LoopCache:
    """All decoding state of one model for one batch of sequences.

    ``valid`` [B, S] marks real (non-padding) positions; ``next_position`` [B] is the
    position id the next token of each row gets; ``iterations`` the loop count it was
    filled with.
    """

    def __init__(self) -> None:
        self.states: dict[tuple[str, int], MixerState] = {}
        self.valid: Optional[torch.Tensor] = None
        self.next_position: Optional[torch.Tensor] = None
        self.padded = False  # whether any position so far is padding
        self.iterations: Optional[int] = None
        self.chunks: dict[int, ChunkState] = {}  # multi-resolution iteration t -> its chunk state

    def get(self, block: str, iteration: int) -> Optional[MixerState]:
        return self.states.get((block, iteration))

    def set(self, block: str, iteration: int, state: MixerState) -> None:
        self.states[(block, iteration)] = state

    def get_seq_length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (e.g. rejected speculative tokens)."""
        if self.valid is None or length >= self.get_seq_length():
            return
        self.states = {key: state.crop(self._compressed(key, length)) for key, state in self.states.items()}
        self.chunks = {t: chunk.crop(length) for t, chunk in self.chunks.items()}
        self.valid = self.valid[:, :length]
        self.next_position = self.valid.long().sum(dim=1)
        self.padded = not bool(self.valid.all())

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (and reorder to) the rows in ``index``, e.g. for beam search or finished rows."""
        self.states = {key: state.select(index) for key, state in self.states.items()}
        self.chunks = {t: chunk.select(index) for t, chunk in self.chunks.items()}
        if self.valid is not None:
            self.valid = self.valid[index]
            self.next_position = self.next_position[index]
            self.padded = not bool(self.valid.all())

    def _compressed(self, key: tuple[str, int], length: int) -> int:
        """Positions a state keeps for the first ``length`` tokens: complete chunks for the core
        blocks of a multi-resolution iteration, ``length`` otherwise."""
        block, t = key
        chunk = self.chunks.get(t) if block.startswith("core.") else None
        return length if chunk is None else chunk.resolution.complete_chunks(length)

    def coarse_triggers(self) -> dict[int, list[int]]:
        """Per multi-resolution iteration, the positions at which its coarse core ran (one per
        completed chunk, at the chunk's last position; spiralformer Appendix D)."""
        return {t: list(chunk.triggers) for t, chunk in sorted(self.chunks.items())}
