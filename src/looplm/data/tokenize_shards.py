"""The ``looplm tokenize`` job: any text source → token shards (:mod:`looplm.data.shards`),
across processes, resumable, a no-op when already done.

The main process reads the documents in training order (:func:`~looplm.data.sources.iter_documents`)
and cuts them into chunks of at least ``shard_chars`` characters; worker processes tokenize
the chunks and write them as shards (tokenizing is the cost; reading and hashing text is
cheap next to it). Chunk boundaries depend only on the documents and ``shard_chars``, so a
re-run plans the same shards: a shard whose record carries its chunk's fingerprint and
whose files match their checksums is kept, any other is (re)written, stale shards of a
shorter input are removed, and the manifest is written last. At most ``2 · num_proc``
chunks are in flight, so memory stays bounded whatever the corpus size. Workers are
spawned, not forked (a forked tokenizer or torch thread pool can deadlock).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import multiprocessing
import platform
import re
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from looplm.artifacts import MANIFEST, CheckpointError, read_json, write_text
from looplm.config_base import ConfigError
from looplm.data.config import DataConfig
from looplm.data.loader import data_tokenizer
from looplm.data.shards import (
    complete_shard, read_manifest, token_dtype, verify_shard_files, write_shard, write_shard_manifest,
)
from looplm.data.source_kinds import ALLOWED, BuiltinCorpus, HubDataset, parse_source
from looplm.data.sources import iter_split_documents, local_files, splits_by_text
from looplm.data.split import texts_digest
from looplm.data.stdlib import corpus_identity
from looplm.data.tokenizer import Tokenizer, build_tokenizer, same_tokenizer, tokenizer_identity

log = logging.getLogger("looplm")

#: Characters of text per shard (~32 MiB of text: about 8M BPE tokens, 16 MiB of uint16).
SHARD_CHARS = 1 << 25
JOB_FILE = "job.json"
_SHARD_FILE = re.compile(r"^shard-(\d{5,})\.")


@dataclasses.dataclass(frozen=True)
class TokenizeResult:
    """What a ``looplm tokenize`` run did: shards in the directory, and how many it wrote now."""

    directory: Path
    shards: int
    documents: int
    tokens: int
    written: int  # shards (re)written by this run
    kept: int  # complete shards from an earlier run, verified and kept
    seconds: float

    @property
    def up_to_date(self) -> bool:
        return self.written == 0


def tokenize_to_shards(
    source: str, out: str | Path, tokenizer: str, num_proc: int = 1, text_field: str = "text",
    hf_config: str | None = None, hf_split: str = "train", streaming: bool = False, shard_chars: int = SHARD_CHARS,
    progress: bool = False,
) -> TokenizeResult:
    """Tokenize ``source`` (any text ``data.source``) with ``tokenizer`` (a ``data.tokenizer``
    spec) into shards in ``out``; see the module docstring for resume and parallelism.
    ``streaming`` reads an ``hf:`` dataset without downloading it whole first (the same
    documents in the same order, so it is not part of the job's settings)."""
    started = time.perf_counter()
    kind = parse_source(source)
    if not kind.holds_text:
        raise ConfigError("SOURCE", source, f"a text source, one of {ALLOWED} ({kind.kind} sources hold no text "
                          "to tokenize)")
    if num_proc < 1 or shard_chars < 1:
        raise ConfigError("--num-proc" if num_proc < 1 else "--shard-chars", min(num_proc, shard_chars),
                          "an integer >= 1")
    cfg = DataConfig(source=source, tokenizer=tokenizer, text_field=text_field, hf_config=hf_config,
                     hf_split=hf_split, streaming=streaming)
    built = data_tokenizer(cfg)  # a bpe:N tokenizer is trained (or found in the cache) here, once
    identity = tokenizer_identity(built)
    settings = {"source": source, "text_field": text_field, "hf_config": hf_config, "hf_split": hf_split,
                "shard_chars": shard_chars}
    inputs = _input_state(cfg)  # checks that a local source exists before anything is written
    directory = Path(out).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    _claim(directory, identity, settings)

    existing = _complete_manifest(directory)
    if existing is not None and inputs is not None and existing.get("inputs") == inputs:
        return _result(directory, existing, written=0, started=started)  # same job, same files, verified: no-op

    for tmp in directory.glob(".tmp-*"):  # left by a run killed mid-write
        tmp.unlink()
    records, written = _write_shards(directory, iter_split_documents(cfg), built.name, shard_chars, num_proc,
                                     progress, with_units=not splits_by_text(cfg.parsed_source))
    if not records:
        raise ConfigError("SOURCE", source, "a source with at least one non-empty document")
    removed = 0
    for path in directory.iterdir():  # shards past the end of a source that shrank
        match = _SHARD_FILE.match(path.name)
        if match and int(match[1]) >= len(records):
            path.unlink()
            removed += 1
    if written or removed or existing is None or existing.get("inputs") != inputs:
        manifest = write_shard_manifest(directory, records, identity, settings, inputs)
    else:
        manifest = existing
    return _result(directory, manifest, written=written, started=started)


def _claim(directory: Path, identity: dict[str, Any], settings: dict[str, Any]) -> None:
    """Record the job in ``job.json``, or refuse a directory holding another job's shards. The
    settings are pinned once a shard exists, and the tokenizer by content (a tokenizer file
    found at another path, e.g. another ``bpe:N`` cache directory, is the same job); before
    that (a run that failed at once, e.g. on a wrong text field) a new job simply replaces
    the record."""
    job = {"tokenizer": identity, "settings": settings}
    path = directory / JOB_FILE
    has_shards = any(_SHARD_FILE.match(p.name) for p in directory.iterdir()) or (directory / MANIFEST).exists()
    if path.is_file() and has_shards:
        previous = read_json(path)
        made_with = previous.get("tokenizer")
        same_tok = (isinstance(made_with, dict) and made_with.keys() == identity.keys()
                    and same_tokenizer(made_with, identity))
        if previous.get("settings") != settings or not same_tok:
            differs = [k for k in settings if previous.get("settings", {}).get(k) != settings[k]]
            if not same_tok:
                differs.insert(0, f"tokenizer (there: {(made_with or {}).get('name')!r})")
            raise ConfigError("OUT", str(directory), "a new directory, or one holding shards of this same job: it "
                              f"holds shards made with other settings ({', '.join(differs)}); choose another "
                              "directory or delete it")
        return
    if has_shards:
        raise ConfigError("OUT", str(directory), f"a new directory or one written by `looplm tokenize`: it holds "
                          f"shard files but no {JOB_FILE}; choose another directory or delete it")
    write_text(path, json.dumps(job, indent=2) + "\n", atomic=True)


def _input_state(cfg: DataConfig) -> Any:
    """What identifies the input without tokenizing it: (path, size, mtime) of each local file,
    the Python version for ``pydoc``, the Python version and file fingerprint for
    ``python-stdlib`` (:func:`~looplm.data.stdlib.corpus_identity`); None where unknown (a
    dataset by name), so a re-run reads the source again and keeps every shard whose
    documents are unchanged."""
    source = cfg.parsed_source
    if source == BuiltinCorpus("pydoc"):
        return ["pydoc", platform.python_version()]
    if source == BuiltinCorpus("python-stdlib"):
        return corpus_identity()
    if isinstance(source, HubDataset):
        return None
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in local_files(cfg.source)]


def _complete_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a complete, undamaged earlier run, or None."""
    if not (directory / MANIFEST).is_file():
        return None
    try:
        manifest = read_manifest(directory)
        verify_shard_files(directory, manifest)
    except CheckpointError as err:
        log.warning("%s: rebuilding what is damaged (%s)", directory, err)
        return None
    return manifest


def fingerprint(texts: list[str], units: list[float] | None = None) -> str:
    """blake2b-128 of a chunk's documents (length-prefixed UTF-8), and of their split units
    where they do not follow from the texts: a kept shard was made from these."""
    return texts_digest(texts, b"" if units is None else np.asarray(units, dtype=np.float64).tobytes())


def chunks(documents: Iterable[tuple[str, float]], shard_chars: int) -> Iterator[tuple[list[str], list[float]]]:
    """Consecutive non-empty documents ``(texts, units)``, cut after the first to reach ``shard_chars`` characters."""
    texts: list[str] = []
    units: list[float] = []
    chars = 0
    for text, unit in documents:
        if not text:
            continue
        texts.append(text)
        units.append(unit)
        chars += len(text)
        if chars >= shard_chars:
            yield texts, units
            texts, units, chars = [], [], 0
    if texts:
        yield texts, units


def _write_shards(directory: Path, documents: Iterator[tuple[str, float]], tokenizer: str, shard_chars: int,
                  num_proc: int, progress: bool, with_units: bool) -> tuple[list[dict[str, Any]], int]:
    """Plan the chunks, keep complete shards, tokenize and write the rest; return (records, written).
    ``tokenizer`` is a spec :func:`build_tokenizer` loads (``byte`` or a path); ``with_units``: the
    split units are not the texts' own, so the chunk fingerprints cover them."""
    from tqdm import tqdm

    records: dict[int, dict[str, Any]] = {}
    written = 0
    bar = tqdm(desc="tokenize", unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True)

    def done(record: dict[str, Any], index: int, new: bool) -> None:
        nonlocal written
        records[index] = record
        written += new
        bar.update(record["tokens"])
        bar.set_postfix(shards=len(records), written=written)

    pool = multiprocessing.get_context("spawn").Pool(num_proc) if num_proc > 1 else None
    pending: collections.deque = collections.deque()
    try:
        for index, (texts, units) in enumerate(chunks(documents, shard_chars)):
            mark = fingerprint(texts, units if with_units else None)
            kept = complete_shard(directory, index, mark)
            if kept is not None:
                done(kept, index, new=False)
                continue
            if not written and not pending:
                (directory / MANIFEST).unlink(missing_ok=True)  # the directory is incomplete from here on
            task = (str(directory), index, tokenizer, texts, units, mark)
            if pool is None:
                done(tokenize_chunk(task), index, new=True)
                continue
            pending.append((index, pool.apply_async(tokenize_chunk, (task,))))
            while len(pending) >= 2 * num_proc:  # bounded: the reader never runs far ahead of the workers
                i, result = pending.popleft()
                done(result.get(), i, new=True)
        while pending:
            i, result = pending.popleft()
            done(result.get(), i, new=True)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        bar.close()
    return [records[i] for i in sorted(records)], written


@functools.lru_cache(maxsize=2)
def _worker_tokenizer(spec: str) -> Tokenizer:
    """One tokenizer per worker process, built on its first chunk."""
    return build_tokenizer(spec)


def tokenize_chunk(task: tuple[str, int, str, list[str], list[float], str]) -> dict[str, Any]:
    """Tokenize one chunk and write it as shard ``index`` (in a worker): ``task`` is
    ``(directory, index, tokenizer spec, texts, split units, fingerprint)``; return the shard's record."""
    directory, index, spec, texts, units, mark = task
    tokenizer = _worker_tokenizer(spec)
    dtype = token_dtype(tokenizer.vocab_size)
    pieces = [np.array(tokenizer.encode(text) + [tokenizer.eos_id], dtype=dtype) for text in texts]
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum([p.size for p in pieces], out=offsets[1:])
    return write_shard(Path(directory), index, np.concatenate(pieces), offsets, np.array(units, dtype=np.float64), mark,
                       chars=sum(len(t) for t in texts))


def _result(directory: Path, manifest: dict[str, Any], written: int, started: float) -> TokenizeResult:
    shards = manifest["shards"]
    return TokenizeResult(directory, len(shards), int(manifest["documents"]), int(manifest["tokens"]),
                          written=written, kept=len(shards) - written,
                          seconds=time.perf_counter() - started)
