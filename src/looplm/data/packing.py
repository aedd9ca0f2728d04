"""Packing: documents → one eos-joined token stream → fixed windows of ``seq_len + 1`` tokens.

Each document is tokenized and followed by the tokenizer's eos token; the documents are
concatenated in source order and cut into consecutive, non-overlapping windows of
``seq_len + 1`` tokens (inputs ``window[:-1]``, targets ``window[1:]``); the tokens left
over at the end are dropped. Empty documents are skipped (they would add a bare eos).

Two forms of the same packing:

- :func:`packed_corpus`: the whole corpus in memory, train and validation windows as
  tensors, cached per process so training and evaluation tokenize it once;
- :func:`stream_windows`: windows on the fly from any document iterator, holding at most
  one document plus one window of tokens, for streaming sources.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Iterator

import torch
from torch import Tensor

from looplm.data.config import DataConfig
from looplm.data.sources import iter_split_documents
from looplm.data.split import split_documents
from looplm.data.tokenizer import Tokenizer

TOKEN_DTYPE = torch.int32  # windows are stored compactly and widened to int64 per batch


def encode_document(tokenizer: Tokenizer, text: str) -> Tensor:
    """Token ids of ``text`` followed by ``tokenizer.eos_id``: ``[n + 1]`` int32."""
    return torch.tensor(tokenizer.encode(text) + [tokenizer.eos_id], dtype=TOKEN_DTYPE)


def cut_windows(tokens: Tensor, window: int) -> Tensor:
    """Cut ``tokens [n]`` into ``[n // window, window]`` consecutive rows (a view); drop the rest."""
    count = tokens.numel() // window
    return tokens[: count * window].view(count, window)


def stream_windows(documents: Iterable[str], tokenizer: Tokenizer, window: int) -> Iterator[Tensor]:
    """Pack ``documents`` on the fly; yield windows ``[window]`` int32 in stream order."""
    carry = torch.empty(0, dtype=TOKEN_DTYPE)  # < window tokens waiting for the next document
    for text in documents:
        if not text:
            continue
        tokens = torch.cat([carry, encode_document(tokenizer, text)])
        rows = cut_windows(tokens, window)
        for row in rows:
            yield row.clone()  # do not pin the whole document's tensor in a shuffle buffer
        carry = tokens[rows.numel():]


@dataclasses.dataclass(frozen=True)
class PackedCorpus:
    """A corpus packed in memory. ``train`` and ``val``: ``[num_windows, seq_len + 1]`` int32.

    Treat the tensors as read-only: the object is shared through the per-process cache.
    """

    train: Tensor
    val: Tensor
    train_tokens: int  # tokens of the training documents, eos included, before cutting
    val_tokens: int
    train_documents: int
    val_documents: int


def packed_corpus(cfg: DataConfig, tokenizer: Tokenizer) -> PackedCorpus:
    """Tokenize, split (:func:`~looplm.data.split.split_documents`) and pack ``cfg.source``.

    Cached per process on the fields that change the result (source, text_field,
    hf_config, hf_split, seq_len, val_fraction) and the tokenizer (tokenizers compare
    equal when loaded from the same place), so a train stream and the validation batches
    of one run share one tokenization. The source is read once; a file edited later in
    the same process is not re-read.
    """
    key = DataConfig(
        source=cfg.source, text_field=cfg.text_field, hf_config=cfg.hf_config, hf_split=cfg.hf_split,
        seq_len=cfg.seq_len, val_fraction=cfg.val_fraction,
    )
    try:
        hash(tokenizer)
    except TypeError:  # a user tokenizer without value identity: correct, just not cached
        return _pack(key, tokenizer)
    return _pack_cached(key, tokenizer)


def _pack(cfg: DataConfig, tokenizer: Tokenizer) -> PackedCorpus:
    docs: list[Tensor] = []
    units: list[float] = []
    for text, unit in iter_split_documents(cfg):
        if text:
            docs.append(encode_document(tokenizer, text))
            units.append(unit)
    window = cfg.seq_len + 1
    held = split_documents(units, [d.numel() for d in docs], cfg.val_fraction, window)
    train_docs = [d for d, h in zip(docs, held) if not h]
    val_docs = [d for d, h in zip(docs, held) if h]
    train = torch.cat(train_docs) if train_docs else torch.empty(0, dtype=TOKEN_DTYPE)
    val = torch.cat(val_docs) if val_docs else torch.empty(0, dtype=TOKEN_DTYPE)
    return PackedCorpus(
        train=cut_windows(train, window), val=cut_windows(val, window),
        train_tokens=train.numel(), val_tokens=val.numel(),
        train_documents=len(train_docs), val_documents=len(val_docs),
    )


# The one piece of module-level state: a small per-process cache of packed corpora.
_pack_cached = functools.lru_cache(maxsize=4)(_pack)
