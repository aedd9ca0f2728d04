"""Where documents come from: one generator of strings, in a fixed order, for every source.

Packing, the train/validation split and exact resume all rely on this order being the
same on every run and machine, so files are visited in sorted path order and dataset
rows in storage order. Every reader is lazy: streaming over a large source never holds
more than one batch of rows.

Each kind of ``DataConfig.source`` (:mod:`looplm.data.source_kinds`, read as
``DataConfig.parsed_source``) has its reader:

- ``"pydoc"``: CPython's ``pydoc_data.topics.topics``, the English reference
  documentation behind ``help()``: one document per topic, in sorted key order
  (about 80 documents, ~465 KB of text with CPython 3.11; it varies slightly by version).
- ``"python-stdlib"``: the ``*.py`` files of the interpreter's standard library, one document
  per file, held out by the hash of the file's path (:mod:`looplm.data.stdlib`).
- a local ``.txt`` file, read as UTF-8 and split into passages of at least
  ``TXT_PASSAGE_CHARS`` characters at paragraph breaks (:func:`split_passages`); each
  passage is one document, so a corpus that is one long file (a book, a dump) still has a
  held-out split by the hash rule, and a document boundary (eos) falls only at a
  paragraph break. A file with NUL bytes or more than 1% invalid UTF-8 is refused as not
  text; a few invalid bytes are replaced (U+FFFD) with a warning. A ``.jsonl`` file (one JSON object per non-blank line, text in
  ``text_field``), ``.parquet`` file (column ``text_field``, read in row batches), or a
  folder of such files, searched recursively in sorted path order (hidden files and
  folders, and other extensions, are skipped).
- ``"hf:NAME"``: a Hugging Face dataset: a folder written by ``save_to_disk`` is opened
  with ``datasets.load_from_disk`` (``hf_split`` picks the split of a ``DatasetDict``);
  anything else goes to ``datasets.load_dataset(NAME, hf_config, split=hf_split,
  streaming=streaming)``, which also accepts a local folder of json/parquet/csv files.

Null texts are skipped; a missing text field or a non-string text is a ConfigError.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable, Iterator

from looplm.config_base import ConfigError
from looplm.data.config import DataConfig
from looplm.data.source_kinds import ALLOWED, BuiltinCorpus, DataSource, HubDataset, TextPath
from looplm.data.split import document_unit
from looplm.data.stdlib import stdlib_documents

log = logging.getLogger("looplm")

FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
#: Minimum passage length of a .txt file (characters): about a thousand tokens of English
#: under a BPE vocabulary, several windows of the byte tokenizer at small seq_len.
TXT_PASSAGE_CHARS = 4096
#: Invalid UTF-8 tolerated in a .txt file before it is refused as not text (a fraction of its characters).
MAX_INVALID_UTF8 = 0.01
_PARQUET_BATCH_ROWS = 1024


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """Yield the documents of ``cfg.source`` as strings, in a deterministic order."""
    return (text for text, _ in iter_split_documents(cfg))


def iter_split_documents(cfg: DataConfig) -> Iterator[tuple[str, float]]:
    """Yield ``(text, unit)`` per document of ``cfg.source``, in a deterministic order: the unit
    decides the held-out split (:mod:`looplm.data.split`), the hash of the text for every source
    but ``python-stdlib``, whose files are split by the hash of their path."""
    source = cfg.parsed_source
    if not splits_by_text(source):
        return ((text, unit) for text, unit, _ in stdlib_documents())
    return ((text, document_unit(text)) for text in _text_documents(cfg))


def splits_by_text(source: DataSource) -> bool:
    """Whether a source's split units are the hash of each document's text (all but ``python-stdlib``)."""
    return source != BuiltinCorpus("python-stdlib")


def _text_documents(cfg: DataConfig) -> Iterator[str]:
    source = cfg.parsed_source
    if source == BuiltinCorpus("pydoc"):
        return _pydoc_documents()
    if isinstance(source, HubDataset):
        return _hf_documents(cfg)
    if isinstance(source, TextPath):
        return _local_documents(cfg)
    raise ConfigError("data.source", cfg.source, f"a text source here ({source.kind} sources hold no documents: "
                      "shards hold tokens, a task its own examples; give the text the shards were made from)")


def _pydoc_documents() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


# --- local files ------------------------------------------------------------------------


def local_files(source: str) -> list[Path]:
    """The files a local ``data.source`` path stands for, in reading order."""
    path = Path(source).expanduser()
    allowed = ALLOWED
    if not path.exists():
        raise ConfigError("data.source", source, f"{allowed}; no such path exists")
    if path.is_file():
        if path.suffix.lower() not in FILE_SUFFIXES:
            raise ConfigError("data.source", source, f"{allowed}; unknown file type {path.suffix!r}")
        return [path]
    files = sorted(
        p for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in FILE_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise ConfigError("data.source", source, f"{allowed}; the folder holds no {'/'.join(FILE_SUFFIXES)} files")
    return files


def _local_documents(cfg: DataConfig) -> Iterator[str]:
    files = local_files(cfg.source)  # checked eagerly, before the first document is asked for
    return _read_files(files, cfg.text_field)


def _read_files(files: list[Path], field: str) -> Iterator[str]:
    for path in files:
        suffix = path.suffix.lower()
        if suffix == ".txt":
            yield from split_passages(read_text_file(path))
        elif suffix == ".jsonl":
            yield from _read_jsonl(path, field)
        else:
            yield from _read_parquet(path, field)


def read_text_file(path: Path) -> str:
    """A .txt file's text, or a ConfigError if it is not text (NUL bytes, mostly invalid UTF-8)."""
    raw = path.read_bytes()
    if b"\x00" in raw:
        raise ConfigError("data.source", str(path), f"UTF-8 text files: {path} holds NUL bytes, so it is binary, not text")
    text = raw.decode("utf-8", errors="replace")
    invalid = text.count("\ufffd") - raw.count("\ufffd".encode())
    if invalid > MAX_INVALID_UTF8 * max(len(text), 1):
        raise ConfigError(
            "data.source", str(path),
            f"UTF-8 text files: {invalid} of the {len(text)} characters of {path} are invalid UTF-8, so it is binary "
            "or in another encoding (convert it, e.g. iconv -f latin1 -t utf-8)",
        )
    if invalid:
        log.warning("%s: %d invalid UTF-8 byte sequences replaced by U+FFFD", path, invalid)
    return text


def split_passages(text: str, size: int = TXT_PASSAGE_CHARS) -> list[str]:
    """Cut ``text`` into consecutive passages that join back to it exactly.

    A passage ends at the first paragraph break (a blank line) once it holds ``size``
    characters; a paragraph that reaches ``4 · size`` without one ends at a line end, and a
    single line longer than that is cut every ``size`` characters.
    """
    passages, current, length = [], [], 0
    for line in text.splitlines(keepends=True):
        pieces = [line[i:i + size] for i in range(0, len(line), size)] if len(line) > 4 * size else [line]
        for piece in pieces:
            current.append(piece)
            length += len(piece)
            if (length >= size and not piece.strip()) or length >= 4 * size or len(pieces) > 1:
                passages.append("".join(current))
                current, length = [], 0
    if current:
        passages.append("".join(current))
    return passages


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or field not in row:
                keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                raise ConfigError("data.text_field", field, f"a key of every line of {path}; line {lineno} has: {keys}")
            text = _checked_text(row[field], field, f"{path} line {lineno}")
            if text is not None:
                yield text


def _read_parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    columns = pf.schema_arrow.names
    if field not in columns:
        raise ConfigError("data.text_field", field, f"a column of {path}; available: {', '.join(columns)}")
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[field]):
        for value in batch.column(0).to_pylist():
            text = _checked_text(value, field, str(path))
            if text is not None:
                yield text


def _checked_text(value: Any, field: str, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ConfigError("data.text_field", field, f"a field holding strings; in {where} it holds {type(value).__name__}")


# --- Hugging Face datasets ---------------------------------------------------------------


def _hf_documents(cfg: DataConfig) -> Iterator[str]:
    dataset = _open_hf_dataset(cfg)
    columns = dataset.column_names  # None for some streaming datasets: checked per row then
    if columns is not None:
        _check_field(cfg, columns)
        dataset = dataset.select_columns([cfg.text_field])
    return _read_rows(dataset, cfg)


def _read_rows(rows: Iterable[dict[str, Any]], cfg: DataConfig) -> Iterator[str]:
    for row in rows:
        if cfg.text_field not in row:
            _check_field(cfg, list(row))
        text = _checked_text(row[cfg.text_field], cfg.text_field, cfg.source)
        if text is not None:
            yield text


def _check_field(cfg: DataConfig, columns: list[str]) -> None:
    if cfg.text_field not in columns:
        raise ConfigError(
            "data.text_field", cfg.text_field, f"a column of {cfg.source}; available: {', '.join(columns)}"
        )


def _open_hf_dataset(cfg: DataConfig) -> Any:
    """A ``datasets.Dataset`` or (``cfg.streaming``) ``datasets.IterableDataset``."""
    import datasets

    name = cfg.parsed_source.name
    path = Path(name).expanduser()
    if name.startswith(("/", "./", "../", "~")) and not path.exists():
        raise ConfigError("data.source", cfg.source, "'hf:' followed by a dataset name or an existing local path")
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            if cfg.hf_split not in dataset:
                raise ConfigError("data.hf_split", cfg.hf_split, f"a split of {cfg.source}: {', '.join(dataset)}")
            dataset = dataset[cfg.hf_split]
        return dataset.to_iterable_dataset() if cfg.streaming else dataset
    return datasets.load_dataset(name, cfg.hf_config, split=cfg.hf_split, streaming=cfg.streaming)
