"""Configuration of the data pipeline: where text comes from, how it is tokenized and packed."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

from looplm.config_base import Config, check
from looplm.data.shards import SHARD_CHECKS
from looplm.data.source_kinds import DataSource, TaskSource, TokenShards, parse_source
from looplm.data.tokenizer import BPE_HOLDOUT, bpe_vocab
from looplm.tasks.config import validate_task_data


@dataclasses.dataclass(frozen=True)
class DataConfig(Config):
    """Text source, tokenizer and packing.

    ``source`` is parsed once into its kind, ``parsed_source`` (:mod:`looplm.data.source_kinds`).
    It is ``"pydoc"`` (the default built-in corpus: the English reference documentation
    shipped with CPython in ``pydoc_data``), ``"python-stdlib"`` (the standard library's
    Python sources, split by file path: :mod:`looplm.data.stdlib`), a local ``.txt`` / ``.jsonl`` / ``.parquet``
    file or a folder of them, or ``"hf:NAME"`` for a Hugging Face dataset by name or
    local path (``hf_config``, ``hf_split`` apply to it). ``streaming`` packs windows on
    the fly instead of tokenizing everything first (for any source), shuffling within a
    bounded buffer.
    ``tokenizer`` is ``"byte"`` (built-in, no files), ``"bpe:N"`` (a byte-level BPE of N ids
    trained on the source's training split and cached, :mod:`looplm.data.bpe`; then
    ``val_fraction`` is at most ``BPE_HOLDOUT``) or a path to a ``tokenizers`` JSON file or a
    ``transformers`` tokenizer directory.
    ``source="shards:DIR"`` trains from token shards written by ``looplm tokenize``
    (:mod:`looplm.data.shards`): the same windows and split, read by memory map; ``tokenizer``
    must be the one the shards were made with, and ``streaming`` stays false. ``shard_check``
    says how the shards are checked at every start, on every rank: ``sha256`` (every byte
    against the manifest's checksums: minutes at hundreds of GB) or ``shape`` (every file
    present, each array's dtype and length equal to the manifest's counts: a truncated or
    missing file is still caught, a flipped byte is not; rerunning ``looplm tokenize`` with
    the same arguments checks every checksum once).
    ``source="task:NAME"`` selects a generated task (``looplm.tasks``: copy, reverse,
    addition, state_tracking) with its parameters in ``task`` (defaults when omitted); a
    task brings its own vocabulary, so ``tokenizer`` stays at its default (or ``task``).
    """

    source: str = "pydoc"
    tokenizer: str = "byte"
    text_field: str = "text"
    hf_config: Optional[str] = None
    hf_split: str = "train"
    streaming: bool = False
    seq_len: int = 256
    val_fraction: float = 0.05
    val_batches: int = 8
    shuffle: bool = True
    seed: int = 0
    shard_check: str = "sha256"
    # Optional[TaskConfig], typed Any so that a mapping reaches validate_task_data, which
    # builds it with errors naming the exact data.task.* field.
    task: Any = None

    def __post_init__(self) -> None:
        source = self.parsed_source  # a ConfigError naming the allowed kinds for a bad one
        check(self.seq_len >= 1, "data.seq_len", self.seq_len, "an integer >= 1")
        check(0.0 <= self.val_fraction < 1.0, "data.val_fraction", self.val_fraction, "a number in [0, 1)")
        check(self.val_batches >= 0, "data.val_batches", self.val_batches, "an integer >= 0")
        check(self.shard_check in SHARD_CHECKS, "data.shard_check", self.shard_check,
              " or ".join(SHARD_CHECKS) + " (how token shards are checked at start)")
        check(not (self.streaming and isinstance(source, TokenShards)), "data.streaming", self.streaming,
              "false for a shards: source (shards are read by memory map, never loaded whole)")
        check(bpe_vocab(self.tokenizer) is None or self.val_fraction <= BPE_HOLDOUT, "data.val_fraction",
              self.val_fraction, f"at most {BPE_HOLDOUT} with a bpe:N tokenizer, which trains on the documents whose "
              f"split unit is >= {BPE_HOLDOUT}: a larger held-out split would hold documents it was trained on")
        task = source.name if isinstance(source, TaskSource) else None
        object.__setattr__(self, "task", validate_task_data(task, self.tokenizer, self.seq_len, self.task))  # None unless source is task:NAME

    @functools.cached_property
    def parsed_source(self) -> DataSource:
        """``source`` as its typed kind (:mod:`looplm.data.source_kinds`), parsed once."""
        return parse_source(self.source)
