"""Packing over memory-mapped token shards: the windows :func:`~looplm.data.packing.packed_corpus`
would cut from the same corpus, read from disk on demand.

The held-out split is made from the shards' per-document units with the same rule
(:func:`~looplm.data.split.split_documents`); each side's documents, in source order, form one
eos-joined stream, and window ``i`` is stream tokens ``[i·W, (i+1)·W)``, ``W = seq_len + 1``.
A side's stream is stored as *segments*: maximal runs of consecutive documents of that
side within one shard, which are contiguous in the shard's token file. Reading a window is
a binary search over segment starts and one or two memory-map slices, so nothing is
tokenized or held in memory at training time beyond the per-document and segment tables.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from looplm.data.config import DataConfig
from looplm.data.shards import Shard, open_shards
from looplm.data.split import split_documents
from looplm.data.tokenizer import Tokenizer


class ShardWindows:
    """The windows ``[len(self), W]`` of one side (train or validation) of a shard set.

    Indexing with a 1-D integer tensor returns those windows as ``[n, W]`` int64, like
    indexing the in-memory ``[N, W]`` window tensor of a :class:`~looplm.data.packing.PackedCorpus`.
    """

    def __init__(self, shards: list[Shard], doc_shard: np.ndarray, doc_start: np.ndarray, doc_length: np.ndarray,
                 window: int):
        """``doc_*``: the side's documents in order: shard index, start in that shard's tokens, length."""
        self.shards, self.window = shards, window
        if doc_shard.size:
            # A document starts a new segment unless it directly follows the previous one in the same shard.
            new = np.ones(doc_shard.size, dtype=bool)
            new[1:] = (doc_shard[1:] != doc_shard[:-1]) | (doc_start[1:] != doc_start[:-1] + doc_length[:-1])
            first = np.flatnonzero(new)
            self.seg_shard = doc_shard[first]
            self.seg_start = doc_start[first]  # in the shard's token file
            self.seg_length = np.add.reduceat(doc_length, first)
        else:
            self.seg_shard = self.seg_start = self.seg_length = np.zeros(0, dtype=np.int64)
        self.seg_offset = np.cumsum(self.seg_length) - self.seg_length  # start in the side's stream
        self.tokens = int(self.seg_length.sum())
        self.documents = int(doc_shard.size)

    def __len__(self) -> int:
        return self.tokens // self.window

    def __getitem__(self, indices: Tensor) -> Tensor:
        """Windows ``indices [n]`` (each in ``[0, len(self))``) → ``[n, W]`` int64."""
        w = self.window
        out = np.empty((indices.numel(), w), dtype=np.int64)
        for row, i in enumerate(indices.tolist()):
            pos, end = i * w, (i + 1) * w
            seg = int(np.searchsorted(self.seg_offset, pos, side="right")) - 1
            filled = 0
            while pos < end:  # a window spans a segment boundary at most a few times
                skip = pos - int(self.seg_offset[seg])
                n = min(end - pos, int(self.seg_length[seg]) - skip)
                start = int(self.seg_start[seg]) + skip
                out[row, filled:filled + n] = self.shards[int(self.seg_shard[seg])].tokens[start:start + n]
                filled, pos, seg = filled + n, pos + n, seg + 1
        return torch.from_numpy(out)


@dataclasses.dataclass(frozen=True)
class ShardCorpus:
    """A shard set split and packed: the counterpart of :class:`~looplm.data.packing.PackedCorpus`
    (same fields, windows read on demand)."""

    train: ShardWindows
    val: ShardWindows
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int


def shard_corpus(cfg: DataConfig, tokenizer: Tokenizer) -> ShardCorpus:
    """Open, verify, split and index ``cfg.source = "shards:DIR"``; cached per process on
    (directory, seq_len, val_fraction, tokenizer, shard check), so a train stream and the validation
    batches of one run verify the checksums once."""
    args = (cfg.parsed_source.directory, cfg.seq_len, cfg.val_fraction, tokenizer, cfg.shard_check)
    try:
        hash(tokenizer)
    except TypeError:
        return _open(*args)
    return _open_cached(*args)


def _open(directory_name: str, seq_len: int, val_fraction: float, tokenizer: Tokenizer, check: str) -> ShardCorpus:
    directory = Path(directory_name).expanduser()
    shards = open_shards(directory, tokenizer, check)
    units = np.concatenate([s.units for s in shards])
    starts = np.concatenate([s.offsets[:-1] for s in shards]).astype(np.int64)
    lengths = np.concatenate([np.diff(s.offsets) for s in shards]).astype(np.int64)
    owner = np.concatenate([np.full(s.units.shape[0], k, dtype=np.int64) for k, s in enumerate(shards)])
    window = seq_len + 1
    held = units < val_fraction  # the hash rule, vectorized
    if val_fraction > 0.0 and int(lengths[held].sum()) < window:  # the tiny-corpus fallback: the one rule, in full
        held = np.array(split_documents(units.tolist(), lengths.tolist(), val_fraction, window), dtype=bool)
    train = ShardWindows(shards, owner[~held], starts[~held], lengths[~held], window)
    val = ShardWindows(shards, owner[held], starts[held], lengths[held], window)
    return ShardCorpus(train, val, train.tokens, val.tokens, train.documents, val.documents)


# Like packing's cache: the one piece of module-level state, a small per-process cache.
_open_cached = functools.lru_cache(maxsize=4)(_open)
