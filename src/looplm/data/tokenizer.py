"""Tokenizers: one small protocol, a built-in byte tokenizer and a Hugging Face wrapper.

The data pipeline and generation only need ``encode``/``decode`` plus three ids, so any
``tokenizers`` or ``transformers`` tokenizer fits behind the same protocol, and the
byte tokenizer lets every test and CPU experiment run with no files at all.
``tokenizers`` and ``transformers`` are imported lazily so ``looplm`` imports with torch alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

from looplm.config_base import ConfigError

#: ``data.tokenizer = "bpe:N"``: a byte-level BPE of N ids trained on the data source's
#: training split (:mod:`looplm.data.bpe`).
BPE_PREFIX = "bpe:"
#: The smallest BPE vocabulary: the 256 byte symbols, the end-of-document token and one merge.
MIN_BPE_VOCAB = 258
#: A BPE tokenizer trains on the documents whose split unit is at least this, so any
#: ``data.val_fraction`` up to it holds out only documents the tokenizer never saw.
BPE_HOLDOUT = 0.1


def bpe_vocab(spec: str) -> int | None:
    """N of a ``"bpe:N"`` tokenizer spec, None for any other spec; a malformed one is a ConfigError."""
    if not spec.startswith(BPE_PREFIX):
        return None
    value = spec[len(BPE_PREFIX):]
    if not value.isdigit() or int(value) < MIN_BPE_VOCAB:
        raise ConfigError("data.tokenizer", spec, f"'bpe:N' with N an integer >= {MIN_BPE_VOCAB} (e.g. bpe:8192): "
                          "the vocabulary size of a byte-level BPE trained on data.source")
    return int(value)


# Tokens that conventionally end a document, tried in this order when a tokenizer does
# not declare its eos token (a bare ``tokenizers`` JSON has no notion of one).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What looplm needs from a tokenizer.

    ``encode`` adds no special tokens (the packer appends ``eos_id`` after each
    document itself); ``decode`` drops special tokens. ``name`` identifies the
    tokenizer (``"byte"`` or the path it was loaded from).
    """

    name: str
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus one end-of-document token 256 (also used as pad).

    Frozen and field-less, so all instances are equal and hash alike (the packed-corpus
    cache relies on that).
    """

    name: str = dataclasses.field(default="byte", init=False)
    vocab_size: int = dataclasses.field(default=257, init=False)
    eos_id: int = dataclasses.field(default=256, init=False)
    pad_id: int = dataclasses.field(default=256, init=False)

    def encode(self, text: str) -> list[int]:
        # list(bytes) runs in C: ~40 ms for the 465 KB pydoc corpus.
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _find_token(vocab: dict[str, int], candidates: Sequence[str]) -> int | None:
    for token in candidates:
        if token in vocab:
            return vocab[token]
    return None


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (from a ``tokenizer.json`` file) or a ``transformers``
    tokenizer (from a local directory, ``local_files_only=True``) behind :class:`Tokenizer`.

    ``eos_id`` is the tokenizer's declared eos token, else the first of
    :data:`EOS_CANDIDATES` in its vocabulary; a tokenizer with neither is refused.
    ``pad_id`` is its pad token if it has one, else ``eos_id``. ``vocab_size`` counts
    added tokens. Two instances loaded from the same path compare equal.
    """

    def __init__(self, path: str | Path):
        path = Path(path).expanduser()
        self.name = str(path)
        self._backend: Any
        if path.is_file():
            self._backend, self._is_transformers = _load_tokenizers_json(path), False
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
            declared_eos = None
            padding = self._backend.padding
            declared_pad = padding["pad_id"] if padding else None
        else:
            self._backend, self._is_transformers = _load_transformers_dir(path), True
            vocab = self._backend.get_vocab()
            self.vocab_size = len(self._backend)
            declared_eos = self._backend.eos_token_id
            declared_pad = self._backend.pad_token_id
        eos = declared_eos if declared_eos is not None else _find_token(vocab, EOS_CANDIDATES)
        if eos is None:
            raise ConfigError(
                "data.tokenizer", self.name,
                "a tokenizer with an end-of-document token: it declares none and its vocabulary "
                f"has none of {', '.join(EOS_CANDIDATES)}",
            )
        self.eos_id = int(eos)
        pad = declared_pad if declared_pad is not None else _find_token(vocab, PAD_CANDIDATES)
        self.pad_id = int(pad) if pad is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        if self._is_transformers:
            # verbose=False: documents are longer than model_max_length by design (we pack them).
            return list(self._backend.encode(text, add_special_tokens=False, verbose=False))
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def _identity(self) -> tuple:
        return (self.name, self.vocab_size, self.eos_id, self.pad_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFTokenizer) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _load_tokenizers_json(path: Path) -> Any:
    from tokenizers import Tokenizer as RawTokenizer

    try:
        return RawTokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise ConfigError("data.tokenizer", str(path), f"a valid tokenizers JSON file ({err})") from err


def _load_transformers_dir(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(
            "data.tokenizer", str(path), f"a directory saved by a transformers tokenizer's save_pretrained ({err})"
        ) from err


def build_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` → :class:`ByteTokenizer`; a path to a ``tokenizer.json`` file or a
    ``transformers`` tokenizer directory → :class:`HFTokenizer`. ``bpe:N`` needs its corpus:
    :func:`looplm.data.data_tokenizer` builds it from the whole data config."""
    if spec == "byte":
        return ByteTokenizer()
    if bpe_vocab(spec) is not None:
        raise ConfigError("data.tokenizer", spec, "a spec that names a tokenizer by itself here ('byte' or a path): "
                          "a bpe:N tokenizer is trained on data.source, so build it with "
                          "looplm.data.data_tokenizer(data_config)")
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            "data.tokenizer", spec,
            "'byte', a tokenizer.json file or a transformers tokenizer directory; no such path exists",
        )
    return HFTokenizer(path)


#: Files of a ``transformers`` tokenizer directory that define the tokenizer (name prefixes).
TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "spiece", "sentencepiece")


def tokenizer_identity(tokenizer: Tokenizer) -> dict[str, Any]:
    """What identifies a tokenizer across machines: ``{"name", "vocab_size", "eos_id", "sha256"}``.

    ``sha256`` hashes the files it was loaded from (a ``tokenizer.json``, or a ``transformers``
    directory's tokenizer files, :data:`TOKENIZER_FILES`, by name: not its model weights or
    config), so a copy moved elsewhere is the same tokenizer and an edited file at the same
    path is not; None for ``byte`` and for tokenizers not loaded from a path (compared by name
    then). Recorded by token shards and checked against ``data.tokenizer`` when training from them.
    """
    path = Path(tokenizer.name).expanduser()
    digest: str | None = None
    if path.is_file():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    elif path.is_dir():
        h = hashlib.sha256()
        for file in sorted(p for p in path.iterdir() if p.is_file() and p.name.startswith(TOKENIZER_FILES)):
            h.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
        digest = h.hexdigest()
    return {"name": tokenizer.name, "vocab_size": int(tokenizer.vocab_size), "eos_id": int(tokenizer.eos_id),
            "sha256": digest}


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two :func:`tokenizer_identity` records name the same tokenizer (by content where both have
    files, else by name)."""
    if (a["vocab_size"], a["eos_id"]) != (b["vocab_size"], b["eos_id"]):
        return False
    if a["sha256"] is not None and b["sha256"] is not None:
        return a["sha256"] == b["sha256"]
    return a["sha256"] == b["sha256"] and a["name"] == b["name"]
