"""Decoding cache of a looped model.

Under weight sharing the same attention module runs once per iteration, so its keys and
values differ per iteration: slots are keyed by ``(block, iteration)``, never by layer
alone. The cache also keeps which key positions are real tokens (left-padded batches)
and the next position id of every row.

State-passing topologies (``looplm.topology``) act on each position independently, so
the carrier of a past position (an anchor, the MeSH buffer) is never read when later
tokens are decoded; it is recomputed for the new positions only and need not be cached.
"""

from __future__ import annotations

from typing import Optional

import torch


class KVSlot:
    """Keys and values of one attention layer at one iteration: [B, H_kv, S, D] each."""

    def __init__(self) -> None:
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions and return all keys and values so far."""
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def select(self, index: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[index], self.values[index]


class LoopCache:
    """All slots of one model for one batch of sequences.

    ``valid`` [B, S] marks real (non-padding) key positions; ``next_position`` [B] is the
    position id the next token of each row gets.
    """

    def __init__(self) -> None:
        self.slots: dict[tuple[str, int], KVSlot] = {}
        self.valid: Optional[torch.Tensor] = None
        self.next_position: Optional[torch.Tensor] = None
        self.padded = False  # whether any key position so far is padding
        self.iterations: Optional[int] = None

    def slot(self, block: str, iteration: int) -> KVSlot:
        return self.slots.setdefault((block, iteration), KVSlot())

    def get_seq_length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (e.g. rejected speculative tokens)."""
        if self.valid is None or length >= self.get_seq_length():
            return
        for slot in self.slots.values():
            slot.crop(length)
        self.valid = self.valid[:, :length]
        self.next_position = self.valid.long().sum(dim=1)
        self.padded = not bool(self.valid.all())

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (and reorder to) the rows in ``index``, e.g. for beam search or finished rows."""
        for slot in self.slots.values():
            slot.select(index)
        if self.valid is not None:
            self.valid = self.valid[index]
            self.next_position = self.next_position[index]
            self.padded = not bool(self.valid.all())
