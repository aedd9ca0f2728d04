"""The kinds of data source: ``data.source`` parsed once into a typed value.

The config keeps its one-string format (``pydoc``, ``python-stdlib``, a path, ``hf:NAME``,
``shards:DIR``, ``task:NAME``); :func:`parse_source` turns it into one frozen dataclass per
kind, read as ``DataConfig.parsed_source``, and every reader asks the kind
(``isinstance``), never the string's prefix. ``spec()`` gives the string back exactly.

Adding a kind: a frozen subclass of :class:`DataSource` with its ``kind`` (and ``prefix``
for a prefixed one), a line in :data:`PREFIXED` (or :data:`BUILTIN_CORPORA` for a named
built-in corpus), and the reader in :func:`looplm.data.sources.iter_documents`.

This module imports nothing from looplm but ``config_base``, so ``looplm.tasks`` may read it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from looplm.config_base import ConfigError

#: The named built-in corpora (no download): CPython's reference documentation
#: (``pydoc_data``) and the Python sources of the running interpreter's standard library
#: (:mod:`looplm.data.stdlib`).
BUILTIN_CORPORA = ("pydoc", "python-stdlib")


@dataclasses.dataclass(frozen=True)
class DataSource:
    """One parsed ``data.source``. ``holds_text``: it yields documents to tokenize (a task
    brings its own examples, shards hold tokens)."""

    kind: ClassVar[str]
    prefix: ClassVar[str] = ""
    holds_text: ClassVar[bool] = True

    def spec(self) -> str:
        """The ``data.source`` string this was parsed from."""
        (value,) = dataclasses.astuple(self)
        return self.prefix + value


@dataclasses.dataclass(frozen=True)
class BuiltinCorpus(DataSource):
    """A named corpus shipped with Python (:data:`BUILTIN_CORPORA`)."""

    name: str
    kind: ClassVar[str] = "builtin"

    def __post_init__(self) -> None:
        if self.name not in BUILTIN_CORPORA:
            raise ConfigError("data.source", self.name, "a built-in corpus: " + ", ".join(BUILTIN_CORPORA))


@dataclasses.dataclass(frozen=True)
class TextPath(DataSource):
    """A local ``.txt`` / ``.jsonl`` / ``.parquet`` file or a folder of them (checked when read)."""

    path: str
    kind: ClassVar[str] = "path"


@dataclasses.dataclass(frozen=True)
class HubDataset(DataSource):
    """A Hugging Face dataset by name or local path (``data.hf_config``, ``data.hf_split`` apply)."""

    name: str
    kind: ClassVar[str] = "hf"
    prefix: ClassVar[str] = "hf:"


@dataclasses.dataclass(frozen=True)
class TokenShards(DataSource):
    """A directory of token shards written by ``looplm tokenize`` (:mod:`looplm.data.shards`)."""

    directory: str
    kind: ClassVar[str] = "shards"
    prefix: ClassVar[str] = "shards:"
    holds_text: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class TaskSource(DataSource):
    """A generated task (:mod:`looplm.tasks`); its name is checked with ``data.task``."""

    name: str
    kind: ClassVar[str] = "task"
    prefix: ClassVar[str] = "task:"
    holds_text: ClassVar[bool] = False


#: Prefixed kinds: (placeholder, what must follow the prefix), for the help and the errors.
PREFIXED: dict[type[DataSource], tuple[str, str]] = {
    HubDataset: ("NAME", "a dataset name or local path"),
    TokenShards: ("DIR", "a directory written by `looplm tokenize`"),
    TaskSource: ("NAME", "a task name"),
}
KINDS: tuple[type[DataSource], ...] = (BuiltinCorpus, TextPath, *PREFIXED)
ALLOWED = (", ".join(BUILTIN_CORPORA) + " (built-in corpora), a path to a .txt/.jsonl/.parquet file or a folder "
           "of them, " + ", ".join(cls.prefix + placeholder for cls, (placeholder, _) in PREFIXED.items()))


def parse_source(source: str) -> DataSource:
    """``data.source`` → its kind: a known prefix, else a built-in corpus name, else a path."""
    if not isinstance(source, str) or not source:
        raise ConfigError("data.source", source, f"a non-empty string: {ALLOWED}")
    for cls, (_, what) in PREFIXED.items():
        if source.startswith(cls.prefix):
            value = source[len(cls.prefix):]
            if not value:
                raise ConfigError("data.source", source, f"'{cls.prefix}' followed by {what}")
            return cls(value)
    if source in BUILTIN_CORPORA:
        return BuiltinCorpus(source)
    return TextPath(source)
