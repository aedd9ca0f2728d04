"""Batches for training and evaluation, with exact resume and data-parallel sharding.

The training data is one endless sequence of windows: epoch 0's windows in epoch 0's
order, then epoch 1's, and so on (with ``cfg.shuffle`` each epoch has its own order,
from a generator seeded by ``(cfg.seed, epoch)``). Global batch k is windows
``[k·G, (k+1)·G)`` of that sequence, ``G = batch_size · world_size``; batches run
straight across epoch boundaries, so no window is dropped and any batch size works.

Data-parallel contract: rank r's batch k is rows ``[r·batch_size, (r+1)·batch_size)``
of global batch k, i.e. concatenating all ranks' batches along dim 0 gives exactly the
batch a single process with ``batch_size · world_size`` would draw at step k.

Resume: the position in that sequence, ``(epoch, offset)`` counted in windows, is the
whole state; it is the same on every rank and independent of batch size and world size.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Iterator

import torch
from torch import Tensor

from looplm.config_base import ConfigError
from looplm.data.bpe import bpe_tokenizer
from looplm.data.config import DataConfig
from looplm.data.packing import PackedCorpus, packed_corpus, stream_windows
from looplm.data.shard_windows import ShardCorpus, ShardWindows, shard_corpus
from looplm.data.source_kinds import TaskSource, TokenShards
from looplm.data.sources import iter_split_documents
from looplm.data.tokenizer import Tokenizer, bpe_vocab, build_tokenizer
from looplm.tasks.stream import GeneratedTask, TaskStream, task_validation_batches

Batch = tuple[Tensor, Tensor]  # (inputs, targets), each [batch_size, seq_len] int64


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, epoch)`` by blake2b, the same on every machine."""
    digest = hashlib.blake2b(f"looplm.data:{seed}:{epoch}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "big") & (2**63 - 1))


def _as_batch(rows: Tensor) -> Batch:
    """``rows [b, seq_len + 1]`` → contiguous int64 ``(inputs, targets)``, each ``[b, seq_len]``."""
    rows = rows.long()
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _corpus(cfg: DataConfig, tokenizer: Tokenizer) -> PackedCorpus | ShardCorpus:
    """The packed windows of a non-streaming source: memory-mapped shards for ``shards:DIR``
    (:mod:`looplm.data.shard_windows`), else the corpus tokenized and packed in memory."""
    return shard_corpus(cfg, tokenizer) if isinstance(cfg.parsed_source, TokenShards) else packed_corpus(cfg, tokenizer)


def _too_small(cfg: DataConfig, corpus: PackedCorpus | ShardCorpus | None) -> ConfigError:
    """No training window: say how the source was split, so the fix is clear."""
    if corpus is None:
        has = "fewer"
    else:
        has = (f"{corpus.train_tokens} tokens in {corpus.train_documents} documents (the held-out split, "
               f"data.val_fraction={cfg.val_fraction:g}, took {corpus.val_documents} documents, {corpus.val_tokens} tokens)")
    return ConfigError(
        "data.seq_len", cfg.seq_len,
        f"small enough for one training window: a window needs seq_len + 1 = {cfg.seq_len + 1} tokens, "
        f"but the training split of {cfg.source!r} has {has}; use more data, a shorter data.seq_len or a "
        "smaller data.val_fraction",
    )


def _check_parallel(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size")


class _PackedWindows:
    """The window sequence over ``N`` packed windows of ``seq_len + 1`` tokens: index arithmetic
    only. ``windows`` is the in-memory ``[N, seq_len + 1]`` tensor or a memory-mapped
    :class:`~looplm.data.shard_windows.ShardWindows`; both give ``len`` and rows by index tensor."""

    def __init__(self, windows: Tensor | ShardWindows, shuffle: bool, seed: int):
        self.windows, self.shuffle, self.seed = windows, shuffle, seed
        self.epoch = self.offset = 0
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    @property
    def per_epoch(self) -> int:
        return len(self.windows)

    def _order_of(self, epoch: int) -> Tensor:
        if epoch != self._order_epoch:
            n = self.per_epoch
            if self.shuffle:
                self._order = torch.randperm(n, generator=epoch_generator(self.seed, epoch))
            else:
                self._order = torch.arange(n)
            self._order_epoch = epoch
        return self._order

    def skip(self, count: int) -> None:
        self.epoch, self.offset = divmod(self.epoch * self.per_epoch + self.offset + count, self.per_epoch)

    def take(self, count: int) -> Tensor:
        parts = []
        while count:
            n = min(count, self.per_epoch - self.offset)
            parts.append(self.windows[self._order_of(self.epoch)[self.offset : self.offset + n]])
            self.skip(n)
            count -= n
        return torch.cat(parts)

    def restore(self, epoch: int, offset: int, per_epoch: int | None) -> None:
        if per_epoch is not None and per_epoch != self.per_epoch:
            raise ValueError(
                f"cannot resume: the training data now packs into {self.per_epoch} windows per epoch, the saved "
                f"state has {per_epoch}; data.source, tokenizer, seq_len and val_fraction must be unchanged"
            )
        self.epoch, self.offset = divmod(epoch * self.per_epoch + offset, self.per_epoch)


class _StreamedWindows:
    """The window sequence packed on the fly from a streaming source.

    Shuffling uses a bounded buffer of ``buffer_size`` windows seeded by ``(seed, epoch)``
    (each arriving window replaces a uniformly chosen buffered one, which is emitted; the
    rest are emitted in a random order at the end of the epoch), so the order is random
    only within a horizon of about ``buffer_size`` windows. Resume replays the epoch from
    its start and discards ``offset`` windows: exact, at the cost of re-tokenizing them.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, buffer_size: int):
        self.cfg, self.tokenizer, self.buffer_size = cfg, tokenizer, buffer_size
        self.epoch = self.offset = 0
        self._iter: Iterator[Tensor] | None = self._open(0)  # opens the source now: config errors surface early
        self._produced = 0  # windows drawn from self._iter (== offset once caught up)

    @property
    def per_epoch(self) -> None:
        """Unknown in advance when streaming."""
        return None

    def _open(self, epoch: int) -> Iterator[Tensor]:
        cfg = self.cfg
        docs = (text for text, unit in iter_split_documents(cfg) if unit >= cfg.val_fraction)
        windows = stream_windows(docs, self.tokenizer, cfg.seq_len + 1)
        return _shuffle_buffer(windows, self.buffer_size, epoch_generator(cfg.seed, epoch)) if cfg.shuffle else windows

    def _next_window(self) -> Tensor:
        while True:
            if self._iter is None:
                self._iter, self._produced = self._open(self.epoch), 0
            for window in self._iter:
                self._produced += 1
                if self._produced > self.offset:  # windows up to offset were consumed before a resume
                    self.offset += 1
                    return window
            if self._produced == 0:
                raise _too_small(self.cfg, None)
            self.epoch, self.offset, self._iter = self.epoch + 1, 0, None

    def skip(self, count: int) -> None:
        for _ in range(count):
            self._next_window()

    def take(self, count: int) -> Tensor:
        return torch.stack([self._next_window() for _ in range(count)])

    def restore(self, epoch: int, offset: int, per_epoch: int | None) -> None:
        self.epoch, self.offset, self._iter = epoch, offset, None


def _shuffle_buffer(items: Iterator[Tensor], size: int, generator: torch.Generator) -> Iterator[Tensor]:
    buffer: list[Tensor] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = int(torch.randint(size, (1,), generator=generator))
        yield buffer[j]
        buffer[j] = item
    for j in torch.randperm(len(buffer), generator=generator).tolist():
        yield buffer[j]


class TrainStream:
    """Endless training batches ``(inputs, targets)``, each ``[batch_size, seq_len]`` int64.

    In-memory sources (``cfg.streaming`` false) are tokenized and packed once
    (:func:`~looplm.data.packing.packed_corpus`) and each epoch is a permutation of the
    windows; ``shards:DIR`` gives the same windows read by memory map
    (:func:`~looplm.data.shard_windows.shard_corpus`), nothing tokenized. With ``cfg.streaming`` the windows are packed on the fly and shuffled through
    a bounded buffer of ``shuffle_buffer`` windows (see :class:`_StreamedWindows`); every
    rank reads the whole stream and keeps its rows. See the module docstring for the
    window sequence, the data-parallel contract and the resume state.
    """

    def __init__(
        self, cfg: DataConfig, tokenizer: Tokenizer, batch_size: int, rank: int = 0, world_size: int = 1,
        shuffle_buffer: int = 1024,
    ):
        _check_parallel(batch_size, rank, world_size)
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer={shuffle_buffer} must be >= 1")
        self.cfg, self.batch_size, self.rank, self.world_size = cfg, batch_size, rank, world_size
        self._windows: _PackedWindows | _StreamedWindows
        if cfg.streaming:
            self._windows = _StreamedWindows(cfg, tokenizer, shuffle_buffer)
        else:
            corpus = _corpus(cfg, tokenizer)
            if len(corpus.train) == 0:
                raise _too_small(cfg, corpus)
            self._windows = _PackedWindows(corpus.train, cfg.shuffle, cfg.seed)

    @property
    def epoch(self) -> int:
        """The epoch the next window comes from."""
        return self._windows.epoch

    @property
    def windows_per_epoch(self) -> int | None:
        """Training windows per epoch (None when streaming: not known in advance)."""
        return self._windows.per_epoch

    def __iter__(self) -> "TrainStream":
        return self

    def __next__(self) -> Batch:
        b, r = self.batch_size, self.rank
        self._windows.skip(r * b)
        rows = self._windows.take(b)  # [batch_size, seq_len + 1]
        self._windows.skip((self.world_size - 1 - r) * b)
        return _as_batch(rows)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position: ``{"epoch", "offset", "windows_per_epoch"}`` (windows, global)."""
        w = self._windows
        return {"epoch": w.epoch, "offset": w.offset, "windows_per_epoch": w.per_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, yielding exactly what the saved stream would have yielded next."""
        self._windows.restore(int(state["epoch"]), int(state["offset"]), state.get("windows_per_epoch"))


def data_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer of ``cfg``: a task's own vocabulary for ``source=task:NAME``
    (``looplm.tasks``), a BPE trained on the source for ``tokenizer=bpe:N``
    (:mod:`looplm.data.bpe`), else :func:`build_tokenizer` of ``cfg.tokenizer``."""
    if isinstance(cfg.parsed_source, TaskSource):
        return GeneratedTask(cfg).tokenizer
    vocab = bpe_vocab(cfg.tokenizer)
    if vocab is not None:
        return bpe_tokenizer(cfg, vocab)
    return build_tokenizer(cfg.tokenizer)


def train_stream(
    cfg: DataConfig, tokenizer: Tokenizer, batch_size: int, rank: int = 0, world_size: int = 1
) -> TrainStream | TaskStream:
    """The training stream of ``cfg``: a :class:`~looplm.tasks.TaskStream` for a task source
    (which uses the task's own vocabulary; ``tokenizer`` is ignored), else a :class:`TrainStream`.
    Both keep the same contract: batches, sharding, ``state_dict`` / ``load_state_dict``."""
    if isinstance(cfg.parsed_source, TaskSource):
        return TaskStream(cfg, batch_size, rank, world_size)
    return TrainStream(cfg, tokenizer, batch_size, rank, world_size)


def validation_batches(
    cfg: DataConfig, tokenizer: Tokenizer, batch_size: int, rank: int = 0, world_size: int = 1
) -> list[Batch]:
    """Up to ``cfg.val_batches`` batches of the held-out split, the same ones on every call.

    The held-out windows are taken in order (never shuffled) and dealt as global batches
    with the same data-parallel contract as :class:`TrainStream`. Batches are full; if the
    split has fewer windows than one global batch, the per-rank batch shrinks to
    ``windows // world_size`` rows (so a tiny corpus still gets evaluated), and the list is
    empty only when there are fewer windows than ranks (or ``val_fraction``/``val_batches``
    is 0). Streaming sources use the hash rule alone (no tiny-corpus fallback) and read
    only as many held-out documents as these batches need. A task source gives held-out
    generated examples (:func:`~looplm.tasks.task_validation_batches`; ``tokenizer`` unused).
    """
    if isinstance(cfg.parsed_source, TaskSource):
        return task_validation_batches(cfg, batch_size, rank, world_size)
    _check_parallel(batch_size, rank, world_size)
    if cfg.val_batches == 0 or cfg.val_fraction == 0.0:
        return []
    limit = cfg.val_batches * batch_size * world_size
    if cfg.streaming:
        docs = (text for text, unit in iter_split_documents(cfg) if unit < cfg.val_fraction)
        rows = list(itertools.islice(stream_windows(docs, tokenizer, cfg.seq_len + 1), limit))
        windows = torch.stack(rows) if rows else torch.empty(0, cfg.seq_len + 1, dtype=torch.long)
    else:
        windows = _corpus(cfg, tokenizer).val
    available = min(limit, len(windows))
    per_rank = min(batch_size, available // world_size)
    if per_rank == 0:
        return []
    count = min(cfg.val_batches, available // (per_rank * world_size))
    batches = []
    for k in range(count):
        start = (k * world_size + rank) * per_rank
        batches.append(_as_batch(windows[torch.arange(start, start + per_rank)]))
    return batches
