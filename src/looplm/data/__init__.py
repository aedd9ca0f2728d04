"""Data pipeline: text sources (typed kinds, :mod:`looplm.data.source_kinds`; the built-in
``pydoc`` and ``python-stdlib`` corpora), tokenizers (``bpe:N`` trained on the source,
:mod:`looplm.data.bpe`), packing into windows, train/validation batches (and generated
tasks, ``data.source=task:NAME``, from ``looplm.tasks``; token shards written by
:func:`tokenize_to_shards`, ``looplm tokenize``, and read as ``data.source=shards:DIR``)."""

from looplm.data.config import DataConfig
from looplm.data.loader import TrainStream, data_tokenizer, train_stream, validation_batches
from looplm.data.sources import iter_documents
from looplm.data.tokenize_shards import TokenizeResult, tokenize_to_shards
from looplm.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "DataConfig",
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "iter_documents",
    "TrainStream",
    "data_tokenizer",
    "train_stream",
    "validation_batches",
    "tokenize_to_shards",
    "TokenizeResult",
]
