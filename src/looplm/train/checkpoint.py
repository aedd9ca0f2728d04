"""Training checkpoints: atomic, verified, and complete enough to resume bit for bit.

Layout of a run directory::

    out_dir/checkpoints/
        latest                   # text: the name of the newest complete step directory
        step_0000500/
            model.safetensors    # weights (safetensors.torch.save_model: a tied matrix stored once)
            config.json          # RunConfig.to_dict() of the run that wrote it
            trainer.pt           # optimiser state, step, tokens seen, data position, RNG, counters
            manifest.json        # {"format", "step", "files": {name: sha256}}, written last

An FSDP run's step directory also holds ``dcp/``, the sharded weights and optimiser state
(:mod:`looplm.train.sharded_checkpoint`), listed in the manifest like the other files.

Atomicity: a checkpoint is written into a hidden temporary directory beside the final
one, every file and the directory are fsync'ed, the directory is renamed to
``step_NNNNNNN`` and only then is ``latest`` replaced (temporary file, fsync,
``os.replace``). A process killed at any point leaves ``latest`` naming the previous
complete checkpoint; leftovers of an interrupted save are removed by the next save.
``latest`` is the only source of truth: a step directory it does not name is never loaded
through a run or checkpoints directory.

Loading verifies every file against the manifest's sha256 and the model config against
the current run's, and reads ``trainer.pt`` with ``torch.load(weights_only=True)``: the
payload holds only tensors, numbers, strings, lists, tuples, dicts and None (AdamW's
state, ``random.getstate()``, byte RNG tensors), so no pickled code is ever executed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from looplm.artifacts import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    MODEL_FILE,
    CheckpointError,
    fsync_dir,
    load_weights,
    locate_weights,
    read_json,
    step_of,
    verify_manifest,
    write_manifest,
    write_text,
)
from looplm.config_base import Config, ConfigError
from looplm.model import LoopLM

logger = logging.getLogger("looplm")

TRAINER_FILE = "trainer.pt"
FILES = (MODEL_FILE, CONFIG_FILE, TRAINER_FILE)
_TEMP_PREFIXES = (".tmp-", ".old-")

PathLike = Union[str, os.PathLike]


@dataclasses.dataclass
class Checkpoint:
    """A loaded checkpoint. path: its step directory. config: the saved RunConfig as a
    dict. state: the contents of ``trainer.pt`` (``step``, ``optimizer`` and whatever
    the trainer stored: ``tokens_seen``, ``data``, ``rng``, counters)."""

    path: Path
    step: int
    config: dict[str, Any]
    state: dict[str, Any]


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def checkpoints_dir(out_dir: PathLike) -> Path:
    return Path(out_dir) / CHECKPOINTS_DIR


def has_checkpoints(out_dir: PathLike) -> bool:
    """Whether ``out_dir`` holds a ``latest`` pointer or any step directory."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return False
    return (root / LATEST).exists() or any(step_of(p.name) is not None for p in root.iterdir())


# ---------------------------------------------------------------------------- saving
def save_checkpoint(
    out_dir: PathLike,
    *,
    step: int,
    model: nn.Module,
    run_config: Config,
    optimizer: Optional[torch.optim.Optimizer] = None,
    state: Optional[dict[str, Any]] = None,
    keep_last: Optional[int] = None,
) -> Path:
    """Write ``out_dir/checkpoints/step_{step:07d}/`` atomically and point ``latest`` at it.

    model: the plain module (not DDP- or compile-wrapped, so parameter names are the
    model's own). state: extra JSON-like values for ``trainer.pt`` (tensors allowed).
    keep_last: keep only this many step directories at or below ``step`` (None keeps
    all); directories above ``step`` (left by an abandoned run that this one resumed
    before) are left for later saves to replace. Returns the step directory.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be None or >= 1")
    from safetensors.torch import save_model

    root = checkpoints_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_leftovers(root)
    name = step_dir_name(step)
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    payload = {"format": FORMAT_VERSION, "step": step, "optimizer": optimizer.state_dict() if optimizer else None}
    payload.update(state or {})
    try:
        save_model(model, str(tmp / MODEL_FILE))
        write_text(tmp / CONFIG_FILE, json.dumps(run_config.to_dict(), indent=2) + "\n")
        torch.save(payload, tmp / TRAINER_FILE)
        write_manifest(tmp, FILES, step=step)
        fsync_dir(tmp)
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_text(root / LATEST, name + "\n", atomic=True)
    if keep_last is not None:
        prune_checkpoints(root, step, keep_last)
    return final


def commit_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, replacing an existing ``final`` (rename(2) cannot
    replace a non-empty directory, so the old one is moved aside first and put back if
    the rename fails)."""
    aside = None
    if final.exists():
        aside = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except BaseException:
        if aside is not None:
            os.replace(aside, final)
        raise
    fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(root: Path) -> None:
    """Remove the temporary directories of saves that were killed midway (only one process saves)."""
    for path in root.iterdir():
        if path.name.startswith(_TEMP_PREFIXES):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def prune_checkpoints(root: Path, step: int, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints up to ``step``; later ones are left alone."""
    steps = sorted(s for s in (step_of(p.name) for p in root.iterdir() if p.is_dir()) if s is not None and s <= step)
    for old in steps[:-keep_last]:
        shutil.rmtree(root / step_dir_name(old), ignore_errors=True)


# ---------------------------------------------------------------------------- loading
def resolve_checkpoint(path: PathLike) -> Path:
    """The step directory meant by ``path``: a run directory or a checkpoints directory
    (through its ``latest``), or a step directory itself (:func:`looplm.artifacts.locate_weights`)."""
    return locate_weights(path)


def verify_checkpoint(step_dir: PathLike) -> dict[str, Any]:
    """Check that every file exists and matches the manifest's sha256; return the manifest
    (training resumes only from a verified checkpoint: no opt-out)."""
    return verify_manifest(step_dir, FILES, skippable=False)


def with_defaults(saved: dict[str, Any], config_cls: type, prefix: str) -> dict[str, Any]:
    """A saved config section as today's ``config_cls`` writes it: fields added since the
    checkpoint take their defaults, so a new option does not block resuming an old run. A
    section that no longer parses is returned as saved (the comparison then names why)."""
    try:
        return config_cls.from_dict(saved, prefix=prefix).to_dict()
    except (ConfigError, TypeError, ValueError):
        return saved


def config_differences(saved: dict[str, Any], current: dict[str, Any], prefix: str) -> list[str]:
    """``"prefix.field: checkpoint X, this run Y"`` for every differing (nested) field."""
    out = []
    for key in sorted(set(saved) | set(current), key=str):
        name = f"{prefix}.{key}"
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, name)
        elif a != b:
            out.append(f"{name}: checkpoint {a!r}, this run {b!r}")
    return out


def load_checkpoint(
    path: PathLike,
    *,
    model: Optional[nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    model_config: Optional[Config] = None,
    map_location: Union[str, torch.device] = "cpu",
) -> Checkpoint:
    """Verify and load a checkpoint; restore ``model`` weights and ``optimizer`` state if given.

    path: a run directory, its ``checkpoints`` directory (both through ``latest``) or a
    step directory. model_config: the current run's model config (defaults to
    ``model.cfg``); a checkpoint saved with a different one is refused, naming the
    differing fields. Weights load onto the device the model's parameters are on.
    """
    step_dir = resolve_checkpoint(path)
    manifest = verify_checkpoint(step_dir)
    config = read_json(step_dir / CONFIG_FILE)
    if model_config is None and isinstance(model, LoopLM):
        model_config = model.cfg
    if model_config is not None:
        saved_model = with_defaults(config.get("model", {}), type(model_config), "model")
        differences = config_differences(saved_model, model_config.to_dict(), "model")
        if differences:
            raise CheckpointError(
                f"checkpoint {step_dir} was saved for a different model; differing fields:\n  "
                + "\n  ".join(differences)
                + "\nuse the checkpoint's model settings, or start a new run in another train.out_dir"
            )
    state = torch.load(step_dir / TRAINER_FILE, map_location=map_location, weights_only=True)
    if state.get("format") != FORMAT_VERSION or state.get("step") != manifest.get("step"):
        raise CheckpointError(
            f"checkpoint {step_dir}: {TRAINER_FILE} has format {state.get('format')!r} and step "
            f"{state.get('step')!r}; expected format {FORMAT_VERSION} and the manifest's step {manifest.get('step')!r}"
        )
    if model is not None:
        load_weights(model, step_dir / MODEL_FILE, device=str(next(model.parameters()).device))
    if optimizer is not None:
        if state.get("optimizer") is None:
            where = (": it is sharded in dcp/ (an FSDP run's); restore it with "
                     "looplm.train.sharded_checkpoint.restore_weights") if (step_dir / "dcp").is_dir() else ""
            raise CheckpointError(f"checkpoint {step_dir} has no optimizer state{where}")
        optimizer.load_state_dict(state["optimizer"])
    return Checkpoint(path=step_dir, step=int(state["step"]), config=config, state=state)


# ---------------------------------------------------------------------------- RNG state
def rng_state() -> dict[str, Any]:
    """Python ``random``, torch CPU and (when CUDA is in use) every CUDA device's generator."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (CUDA only when the device count matches)."""
    python = state["python"]
    # weights_only loading returns Python's state with lists where getstate() had tuples
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
        else:
            logger.warning(
                "checkpoint has CUDA RNG states for %d devices, this machine has %d: CUDA RNG not restored",
                len(cuda), torch.cuda.device_count(),
            )
