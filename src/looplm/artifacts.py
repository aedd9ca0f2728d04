"""Files looplm writes and reads back: written durably, verified before use.

Every directory of weights looplm writes (a training checkpoint, a ``save_pretrained``
directory) ends with ``manifest.json``, written last::

    {"format": 1, "files": {"model.safetensors": "<sha256>", "config.json": "<sha256>", ...}, ...}

A reader verifies every listed file against it before loading anything, so flipped
bytes, a truncated file, a missing file or a missing manifest are refused with one
:class:`CheckpointError` naming the file, instead of a model that silently computes
something else. ``verify=False`` on the loaders skips the check, for forensics on a
damaged directory; the safetensors header is still parsed, and a broken one is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable, Union

from torch import nn

from looplm.errors import LoopLMError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"
CHECKPOINTS_DIR, LATEST = "checkpoints", "latest"
STEP_DIR = re.compile(r"^step_(\d{7,})$")

PathLike = Union[str, os.PathLike]


class CheckpointError(LoopLMError, RuntimeError):
    """Weights on disk that cannot be used: missing, incomplete, corrupted or for another model."""


# ---------------------------------------------------------------------------- writing
def write_text(path: Path, text: str, atomic: bool = False) -> None:
    """Write and fsync; with ``atomic`` through a temporary file and ``os.replace``, so a
    reader sees the old file or the new one, never half of one."""
    target = path
    if atomic:
        fd, tmp_name = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
        os.close(fd)
        target = Path(tmp_name)
    try:
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if atomic:
            os.replace(target, path)
            fsync_dir(path.parent)
    except BaseException:
        if atomic:
            target.unlink(missing_ok=True)
        raise


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    if os.name != "posix":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, files: Iterable[str], **extra: Any) -> None:
    """fsync ``files`` of ``directory``, then write the manifest of their sha256 (last,
    atomically): a directory with a manifest is complete."""
    files = list(files)
    for name in files:
        fsync_file(directory / name)
    manifest = {"format": FORMAT_VERSION, **extra, "files": {name: sha256(directory / name) for name in files}}
    write_text(directory / MANIFEST, json.dumps(manifest, indent=2) + "\n", atomic=True)


# ---------------------------------------------------------------------------- reading
def verify_manifest(directory: PathLike, required: Iterable[str], skippable: bool = True) -> dict[str, Any]:
    """Check that ``directory`` has a manifest listing every ``required`` file and that every
    file it lists exists with the recorded sha256; return the manifest. ``skippable``: the
    reader offers ``verify=False`` (--no-verify), and the refusal says so; resuming training
    does not, and its refusal points at an earlier checkpoint instead."""
    directory = Path(directory)

    def _unverified(problem: str) -> CheckpointError:
        if not skippable:
            return CheckpointError(f"{problem}; resume from an earlier checkpoint (pass its step directory)")
        return CheckpointError(f"{problem}. To load it anyway for inspection, pass verify=False",
                               cli_hint=f"{problem}. To load it anyway for inspection, add --no-verify")

    path = directory / MANIFEST
    if not path.is_file():
        raise _unverified(f"{directory} is incomplete or was not written by looplm: {MANIFEST} is missing, so its "
                          "files cannot be verified")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError(f"'files' is a {type(files).__name__}, not a mapping")
    except (ValueError, KeyError, TypeError) as err:
        raise _unverified(f"{directory} is corrupted: {MANIFEST} is unreadable ({err})") from err
    unlisted = [name for name in required if name not in files]
    if unlisted:
        raise _unverified(f"{directory} is corrupted: {MANIFEST} has no checksum for {', '.join(unlisted)}")
    missing = [name for name in files if not (directory / name).is_file()]
    if missing:
        raise _unverified(f"{directory} is incomplete: missing {', '.join(missing)}")
    for name, recorded in files.items():
        actual = sha256(directory / name)
        if actual != recorded:
            raise _unverified(f"{directory} is corrupted: {name} has sha256 {actual[:16]}…, the manifest records "
                              f"{str(recorded)[:16]}…; use an earlier checkpoint or a fresh copy")
    return manifest


def step_of(name: str) -> int | None:
    """The step of a ``step_NNNNNNN`` directory name (None for any other name)."""
    match = STEP_DIR.match(name)
    return int(match[1]) if match else None


def locate_weights(path: PathLike) -> Path:
    """The directory of weights meant by ``path``: a run directory or its ``checkpoints``
    directory (through ``latest``, the only source of truth there), a checkpoint step
    directory, or a ``save_pretrained`` directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"no checkpoint at {path}: the path does not exist (expected a run directory, a checkpoint directory or "
            "a save_pretrained directory)"
        )
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: it is a file, not a run, checkpoint or save_pretrained directory")
    if (path / MANIFEST).exists() or (path / MODEL_FILE).exists() or step_of(path.name) is not None:
        return path
    root = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
    latest = root / LATEST
    steps = sorted(p.name for p in root.iterdir() if p.is_dir() and step_of(p.name) is not None)
    if not latest.is_file():
        if root.name != CHECKPOINTS_DIR:
            raise CheckpointError(
                f"no checkpoint at {path}: expected a run directory (with {CHECKPOINTS_DIR}/{LATEST}), a "
                f"checkpoint directory (with {MANIFEST}) or a save_pretrained directory (with {MODEL_FILE})"
            )
        if not steps:
            raise CheckpointError(
                f"{path} has no checkpoint yet: {root} is empty (the run saved none; train it, or wait for its "
                "first save, train.save_every)"
            )
        raise CheckpointError(
            f"{latest} is missing, so the newest complete checkpoint of {path} is unknown; pass a step directory "
            f"explicitly, e.g. {root / steps[-1]}"
        )
    try:
        name = latest.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        name = "<not text>"
    if step_of(name) is None:
        hint = f"; pass a step directory explicitly, e.g. {root / steps[-1]}" if steps else ""
        raise CheckpointError(f"{latest} is corrupted: it names {name[:40]!r}, not a step_NNNNNNN directory{hint}")
    step_dir = root / name
    if not step_dir.is_dir():
        raise CheckpointError(f"{latest} names {name}, but {step_dir} does not exist")
    return step_dir


def read_weights_dir(path: PathLike, verify: bool = True) -> tuple[Path, dict[str, Any]]:
    """Locate the weights meant by ``path``, verify them against their manifest (unless
    ``verify=False``) and return (directory, its parsed ``config.json``)."""
    directory = locate_weights(path)
    if verify:
        verify_manifest(directory, (MODEL_FILE, CONFIG_FILE))
    return directory, read_json(directory / CONFIG_FILE)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or a CheckpointError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is corrupted: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is corrupted: a JSON {type(data).__name__}, not an object")
    return data


def load_weights(model: nn.Module, path: Path, device: str = "cpu") -> None:
    """Load ``model.safetensors`` into ``model`` (strict); an unreadable file or one for
    another model is a CheckpointError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        load_model(model, str(path), strict=True, device=device)
    except SafetensorError as err:
        raise CheckpointError(f"{path} is corrupted: not a readable safetensors file ({err})") from err
    except RuntimeError as err:  # strict loading: missing or unexpected tensors, wrong shapes
        raise CheckpointError(f"{path} does not hold this model's weights: {err}") from err


def load_tensors(path: Path) -> dict[str, Any]:
    """Every tensor of a safetensors file (a foreign checkpoint: no manifest to verify); an
    unreadable file is a CheckpointError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as err:
        raise CheckpointError(f"{path} is corrupted: not a readable safetensors file ({err})") from err
