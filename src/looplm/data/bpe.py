"""``data.tokenizer = "bpe:N"``: a byte-level BPE of N ids trained on the data source itself.

Trained through Hugging Face ``tokenizers`` (the ``hf`` extra) on the documents of
``data.source`` whose split unit is at least :data:`~looplm.data.tokenizer.BPE_HOLDOUT`
(so with any ``data.val_fraction`` up to it, no held-out document was seen by the
tokenizer; for ``python-stdlib`` the unit is the hash of the file's path, so this is a
fixed set of files). The model is GPT-2's: byte-level pre-tokenization (every string
encodes, decoding gives it back exactly), BPE merges, one special token ``<|endoftext|>``
(id 0) that ends each document. Training reads the whole training split into memory: it is
meant for corpora of up to a few hundred MB (the built-in ones, local files).

The trained tokenizer is cached at ``<cache>/tokenizers/bpe-N-<fingerprint>/tokenizer.json``
(:func:`cache_dir`), the fingerprint hashing the training documents, so the same corpus and
N load it again, and a changed corpus trains a new one; ``meta.json`` beside it records the
corpus (for ``python-stdlib`` the Python version and file fingerprint, :mod:`looplm.data.stdlib`).
Training is deterministic (documents in source order; merge ties broken by the pair's ids): the same corpus gives
the same file on every machine, so shards made elsewhere match it by checksum.

With ``data.source=shards:DIR`` the corpus is the one the shards were made from (their
manifest's settings).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from looplm.artifacts import write_text
from looplm.config_base import ConfigError
from looplm.data.config import DataConfig
from looplm.data.shards import read_manifest
from looplm.data.source_kinds import BuiltinCorpus, TokenShards
from looplm.data.sources import iter_split_documents
from looplm.data.split import texts_digest
from looplm.data.stdlib import corpus_identity
from looplm.data.tokenizer import BPE_HOLDOUT, HFTokenizer

#: Environment variable naming the cache directory (default ``$XDG_CACHE_HOME/looplm`` or ``~/.cache/looplm``).
CACHE_ENV = "LOOPLM_CACHE_DIR"
EOS_TOKEN = "<|endoftext|>"
META_FILE = "meta.json"


def cache_dir() -> Path:
    """Where looplm keeps what it derives from data (trained tokenizers)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "looplm"


def corpus_of(cfg: DataConfig) -> DataConfig:
    """The text source a ``bpe:N`` tokenizer trains on: ``cfg`` itself, or for ``shards:DIR`` the
    source the shards were made from."""
    source = cfg.parsed_source
    if isinstance(source, TokenShards):
        settings = read_manifest(Path(source.directory).expanduser())["settings"]
        return DataConfig(source=settings["source"], text_field=settings["text_field"],
                          hf_config=settings["hf_config"], hf_split=settings["hf_split"])
    if not source.holds_text:
        raise ConfigError("data.tokenizer", cfg.tokenizer, f"'byte' or a path with data.source={cfg.source!r}: "
                          "a bpe:N tokenizer trains on a text source")
    return cfg


def training_texts(cfg: DataConfig) -> list[str]:
    """The documents a ``bpe:N`` tokenizer trains on, in source order (non-empty, unit >= BPE_HOLDOUT)."""
    return [text for text, unit in iter_split_documents(cfg) if text and unit >= BPE_HOLDOUT]


def bpe_tokenizer(cfg: DataConfig, vocab_size: int) -> HFTokenizer:
    """The ``bpe:vocab_size`` tokenizer of ``cfg``'s corpus: loaded from the cache, else trained and cached."""
    corpus = corpus_of(cfg)
    texts = training_texts(corpus)
    if not texts:
        raise ConfigError("data.tokenizer", cfg.tokenizer, f"a corpus to train on: {corpus.source!r} has no document "
                          f"with split unit >= {BPE_HOLDOUT} (BPE_HOLDOUT)")
    mark = texts_digest(texts)
    path = cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{mark[:16]}" / "tokenizer.json"
    if not path.is_file():  # the tokenizer file, written last and atomically, marks a complete entry
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = _meta(corpus, vocab_size, mark, texts)
        write_text(path.parent / META_FILE, json.dumps(meta, indent=2) + "\n", atomic=True)
        write_text(path, train_bpe(texts, vocab_size), atomic=True)
    return HFTokenizer(path)


def _meta(corpus: DataConfig, vocab_size: int, mark: str, texts: list[str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"vocab_size": vocab_size, "source": corpus.source, "holdout": BPE_HOLDOUT,
                            "documents": len(texts), "chars": sum(len(t) for t in texts), "fingerprint": mark}
    if corpus.parsed_source == BuiltinCorpus("python-stdlib"):
        meta["corpus"] = corpus_identity()
    if corpus.parsed_source.kind == "hf":
        meta.update(text_field=corpus.text_field, hf_config=corpus.hf_config, hf_split=corpus.hf_split)
    return meta


def train_bpe(texts: list[str], vocab_size: int) -> str:
    """A byte-level BPE of ``vocab_size`` ids (``<|endoftext|>`` = 0) trained on ``texts``, as
    ``tokenizer.json`` text. ``tokenizers`` counts words in threads; the merges only depend on
    the counts (ties broken by the pair's ids), so the result is the same on every run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return tokenizer.to_str(pretty=True)
