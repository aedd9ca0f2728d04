"""The ``python-stdlib`` corpus: the Python sources of the running interpreter's standard library.

Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (about 1,800 files, 31 MB with
CPython 3.11; present on every Python install, no download) is one document, in sorted
order of its path relative to that root (``/``-separated). Included: the whole library,
its ``test`` package, ``idlelib``, ``lib2to3`` and ``pydoc_data`` too (all of it Python
source). Excluded: folders named ``site-packages`` / ``dist-packages`` (third-party
packages installed into the interpreter), ``__pycache__``, hidden files and folders, and
files that are not valid UTF-8 (a few test files written in other encodings on purpose),
and empty files. ``LOOPLM_STDLIB_ROOT`` points it at another directory (the tests use a
small fake library).

The held-out split is by file, decided by the hash of the relative path
(:func:`path_unit`), not of the text: a file stays on its side across Python patch
versions that edit it, and on every machine. ``data.val_fraction`` picks the held-out files
exactly as for every other source (unit below it). :func:`corpus_identity` (the Python
version and a fingerprint of the file list and contents) goes into the metadata of what is
made from the corpus (token shards, the BPE tokenizer), so a study can tell when the
corpus differs.
"""

from __future__ import annotations

import functools
import os
import platform
import sysconfig
from pathlib import Path
from typing import Any, Iterator

from looplm.config_base import ConfigError
from looplm.data.split import document_unit, texts_digest

#: Environment variable naming another root for the corpus (tests, or a pinned copy).
STDLIB_ROOT_ENV = "LOOPLM_STDLIB_ROOT"
#: Folder names skipped anywhere under the root.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """``$LOOPLM_STDLIB_ROOT`` if set, else the running interpreter's stdlib directory."""
    override = os.environ.get(STDLIB_ROOT_ENV)
    return Path(override).expanduser() if override else Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """``(relative path, path)`` of every candidate ``*.py`` file, sorted by relative path
    (see the module docstring for what is excluded; UTF-8 and emptiness are checked on reading)."""
    root = stdlib_root() if root is None else root
    if not root.is_dir():
        raise ConfigError("data.source", "python-stdlib", f"a standard library directory: {root} does not exist "
                          f"(set {STDLIB_ROOT_ENV} to the folder of the library's .py files)")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("."):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def path_unit(relative: str) -> float:
    """The split unit of a file: :func:`~looplm.data.split.document_unit` of its relative path."""
    return document_unit(relative)


def read_source(path: Path) -> str | None:
    """A file's text, or None when it is empty or not valid UTF-8 (left out of the corpus)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text or None


def stdlib_documents(root: Path | None = None) -> Iterator[tuple[str, float, str]]:
    """``(text, unit, relative path)`` of each file of the corpus, in order."""
    for relative, path in stdlib_files(root):
        text = read_source(path)
        if text is not None:
            yield text, path_unit(relative), relative


def corpus_identity(root: Path | None = None) -> dict[str, Any]:
    """``{"corpus", "python", "files", "chars", "fingerprint"}``: the Python version, the number of
    files and characters, and blake2b-128 of every file's relative path and text (in order)."""
    root = stdlib_root() if root is None else root
    return dict(_identity(str(root.resolve()), _mtimes(root)))


def _mtimes(root: Path) -> tuple[tuple[str, int, int], ...]:
    """What says a file changed, without reading it (the key of :func:`_identity`'s cache)."""
    return tuple((rel, p.stat().st_size, p.stat().st_mtime_ns) for rel, p in stdlib_files(root))


@functools.lru_cache(maxsize=4)
def _identity(root: str, stamps: tuple[tuple[str, int, int], ...]) -> tuple[tuple[str, Any], ...]:
    documents = [(relative, text) for text, _, relative in stdlib_documents(Path(root))]
    fingerprint = texts_digest(part for pair in documents for part in pair)
    return (("corpus", "python-stdlib"), ("python", platform.python_version()), ("files", len(documents)),
            ("chars", sum(len(text) for _, text in documents)), ("fingerprint", fingerprint))
