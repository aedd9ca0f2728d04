"""Token shards on disk: the format ``looplm tokenize`` writes and ``data.source=shards:DIR`` reads.

A shard directory holds, per shard ``k`` (``shard-00000``, ``shard-00001``, ... in source order):

- ``shard-K.tokens.npy``: ``[n_tokens]`` uint16 (vocabulary <= 65536) or uint32: each
  document's tokens followed by the eos token, documents concatenated in source order;
  empty documents are skipped (as :mod:`looplm.data.packing` skips them);
- ``shard-K.offsets.npy``: ``[n_documents + 1]`` int64, document d is
  ``tokens[offsets[d]:offsets[d + 1]]`` (eos included);
- ``shard-K.units.npy``: ``[n_documents]`` float64, :func:`~looplm.data.split.document_unit`
  of each document's text;
- ``shard-K.json``: the shard's record (counts, the fingerprint of its input documents,
  sha256 of its three arrays), written last: a shard with a record is complete;

and ``manifest.json`` (written last, atomically, by :func:`write_shard_manifest`): the
tokenizer's identity, the token dtype, per-shard counts, totals, and the sha256 of every
file, in the layout of :mod:`looplm.artifacts` manifests. A directory with a manifest is
complete.

Why units and not a train/validation split: the held-out split is decided at training
time from the units, ``data.val_fraction`` and ``data.seq_len`` (whose tiny-corpus
fallback, :func:`~looplm.data.split.split_documents`, depends on the window), so one set of
shards serves every split and window length, and the split is exactly the one in-memory
packing of the same corpus makes.
"""

from __future__ import annotations

import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from looplm.artifacts import FORMAT_VERSION, MANIFEST, CheckpointError, fsync_dir, read_json, sha256, write_text
from looplm.config_base import ConfigError
from looplm.data.source_kinds import TokenShards
from looplm.data.tokenizer import Tokenizer, same_tokenizer, tokenizer_identity

KIND = "looplm-token-shards"
ARRAYS = ("tokens", "offsets", "units")
#: How ``open_shards`` checks the files (``data.shard_check``): every checksum, or every
#: array's dtype and length against the manifest's counts.
SHARD_CHECKS = ("sha256", "shape")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def array_file(name: str, array: str) -> str:
    return f"{name}.{array}.npy"


def record_file(name: str) -> str:
    return f"{name}.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocabulary <= 65536), else uint32: 2 or 4 bytes per token on disk."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


# ---------------------------------------------------------------------------- writing
def save_array(path: Path, array: np.ndarray) -> str:
    """``np.save`` through a temporary file, fsync and ``os.replace`` (never half a file at
    ``path``); return the sha256 of what was written."""
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return sha256(path)


def write_shard(directory: Path, index: int, tokens: np.ndarray, offsets: np.ndarray, units: np.ndarray,
                fingerprint: str, chars: int) -> dict[str, Any]:
    """Write shard ``index``'s arrays, then its record (the completion mark); return the record."""
    name = shard_name(index)
    files = {array_file(name, key): save_array(directory / array_file(name, key), value)
             for key, value in zip(ARRAYS, (tokens, offsets, units))}
    record = {"name": name, "documents": int(units.shape[0]), "tokens": int(tokens.shape[0]), "chars": chars,
              "fingerprint": fingerprint, "files": files}
    write_text(directory / record_file(name), json.dumps(record, indent=2) + "\n", atomic=True)
    return record


def complete_shard(directory: Path, index: int, fingerprint: str) -> dict[str, Any] | None:
    """Shard ``index``'s record if the shard is complete, made from the documents with
    ``fingerprint`` and its arrays match their checksums; else None (it must be written)."""
    path = directory / record_file(shard_name(index))
    if not path.is_file():
        return None
    try:
        record = read_json(path)
    except CheckpointError:
        return None
    name = shard_name(index)
    if record.get("fingerprint") != fingerprint or record.get("name") != name:
        return None
    files = record.get("files")
    if not isinstance(files, dict) or set(files) != {array_file(name, key) for key in ARRAYS}:
        return None
    if any(not (directory / n).is_file() or sha256(directory / n) != h for n, h in files.items()):
        return None
    return record


def write_shard_manifest(directory: Path, records: list[dict[str, Any]], tokenizer: dict[str, Any],
                         settings: dict[str, Any], inputs: Any) -> dict[str, Any]:
    """The manifest of a complete directory, written last and atomically; return it."""
    files: dict[str, str] = {}
    for record in records:
        files.update(record["files"])
    manifest = {
        "format": FORMAT_VERSION, "kind": KIND, "tokenizer": tokenizer,
        "dtype": token_dtype(tokenizer["vocab_size"]).name, "settings": settings, "inputs": inputs,
        "documents": sum(r["documents"] for r in records), "tokens": sum(r["tokens"] for r in records),
        "shards": [{k: r[k] for k in ("name", "documents", "tokens", "chars", "fingerprint")} for r in records],
        "files": files,
    }
    write_text(directory / MANIFEST, json.dumps(manifest, indent=2) + "\n", atomic=True)
    fsync_dir(directory)
    return manifest


# ---------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class Shard:
    """One shard opened by memory map: ``tokens [n]`` uint16/uint32, ``offsets [d + 1]`` int64,
    ``units [d]`` float64 (read-only views of the files)."""

    name: str
    tokens: np.ndarray
    offsets: np.ndarray
    units: np.ndarray


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a shard directory, or a ConfigError / CheckpointError saying what is wrong."""
    source = TokenShards(str(directory)).spec()
    if not directory.is_dir():
        raise ConfigError("data.source", source, "'shards:' followed by a directory written by `looplm tokenize`; "
                          "no such directory")
    if not (directory / MANIFEST).is_file():
        raise CheckpointError(f"{directory} is not a complete shard directory: {MANIFEST} is missing (an interrupted "
                              "`looplm tokenize`? run it again with the same arguments to finish it)")
    manifest = read_json(directory / MANIFEST)
    if manifest.get("kind") != KIND or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{directory / MANIFEST} is not the manifest of token shards written by `looplm tokenize`")
    return manifest


def check_tokenizer(manifest: dict[str, Any], tokenizer: Tokenizer, directory: Path) -> None:
    """Refuse training with another tokenizer than the one the shards were made with."""
    made, given = manifest["tokenizer"], tokenizer_identity(tokenizer)
    if not same_tokenizer(made, given):
        def show(t: dict[str, Any]) -> str:
            digest = f", sha256 {t['sha256'][:12]}…" if t["sha256"] else ""
            return f"{t['name']!r} (vocab_size {t['vocab_size']}, eos_id {t['eos_id']}{digest})"

        raise ConfigError(
            "data.tokenizer", tokenizer.name,
            f"the tokenizer the shards in {directory} were made with, {show(made)}; data.tokenizer is {show(given)}. "
            "Set data.tokenizer to the shards' tokenizer, or re-run `looplm tokenize` with this one",
        )


def verify_shard_files(directory: Path, manifest: dict[str, Any]) -> None:
    """Check every file the manifest lists against its sha256 (in threads: hashing releases the GIL)."""
    files: dict[str, str] = manifest["files"]
    missing = [n for n in files if not (directory / n).is_file()]
    if missing:
        raise CheckpointError(f"{directory} is incomplete: missing {', '.join(missing)}; re-run `looplm tokenize` "
                              "with the same arguments to rebuild it")
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        actual = dict(zip(files, pool.map(lambda n: sha256(directory / n), files)))
    for name, recorded in files.items():
        if actual[name] != recorded:
            raise CheckpointError(
                f"{directory} is damaged: {name} has sha256 {actual[name][:16]}…, the manifest records "
                f"{recorded[:16]}…; re-run `looplm tokenize` with the same arguments to rebuild that shard"
            )


def open_shards(directory: Path, tokenizer: Tokenizer, check: str = "sha256") -> list[Shard]:
    """The shards of ``directory`` in order, memory-mapped, after checking the tokenizer and
    the files as ``check`` says (:data:`SHARD_CHECKS`); a damaged or incomplete directory
    is a CheckpointError naming the file."""
    manifest = read_manifest(directory)
    check_tokenizer(manifest, tokenizer, directory)
    if check == "sha256":
        verify_shard_files(directory, manifest)
    elif check != "shape":
        raise ConfigError("data.shard_check", check, " or ".join(SHARD_CHECKS))
    shards = []
    for entry in manifest["shards"]:
        name = entry["name"]
        try:
            arrays = [np.load(directory / array_file(name, key), mmap_mode="r", allow_pickle=False) for key in ARRAYS]
        except (OSError, ValueError) as e:  # missing, or a header np.load cannot read
            raise CheckpointError(f"{directory} is damaged or incomplete: {name}: {e}; re-run `looplm tokenize` "
                                  "with the same arguments to rebuild that shard") from e
        shard = Shard(name, *arrays)
        _check_shape(directory, shard, entry, np.dtype(manifest["dtype"]))
        shards.append(shard)
    return shards


def _check_shape(directory: Path, shard: Shard, entry: dict[str, Any], dtype: np.dtype) -> None:
    """Each array's dtype and length as the manifest's counts say (O(1): the .npy headers)."""
    expected = {"tokens": (dtype, entry["tokens"]), "offsets": (np.dtype(np.int64), entry["documents"] + 1),
                "units": (np.dtype(np.float64), entry["documents"])}
    for key, (kind, length) in expected.items():
        array = getattr(shard, key)
        if array.dtype != kind or array.shape != (length,):
            raise CheckpointError(
                f"{directory} is damaged: {array_file(shard.name, key)} holds {array.dtype}[{', '.join(map(str, array.shape))}], "
                f"the manifest records {kind}[{length}]; re-run `looplm tokenize` with the same arguments to rebuild that shard"
            )
