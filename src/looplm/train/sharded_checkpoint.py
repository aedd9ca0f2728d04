"""Sharded checkpoints of FSDP2 runs, through ``torch.distributed.checkpoint`` (DCP).

An FSDP run's step directory holds what any run's does, plus the shards::

    step_0000500/
        model.safetensors   # the consolidated full weights, written by rank 0 at every save,
                            # so eval, generate, export and init_from read it like any run's
        config.json
        trainer.pt          # step, data position, counters, RNG; its optimizer entry is None
        dcp/                # DCP: .metadata and one __R_N.distcp file per rank writing:
                            # {"model": ..., "optimizer": ...} by parameter name, sharded
        manifest.json       # sha256 of every file above, dcp/* included; written last

Saving is collective (every rank writes its shards, then the full weights are gathered
to rank 0) and atomic as :func:`looplm.train.checkpoint.save_checkpoint` is: everything
goes into one hidden temporary directory that rank 0 names, fsyncs, renames to
``step_NNNNNNN`` and only then points ``latest`` at.

Loading (:func:`restore_weights`) works across world sizes and wrappers, because DCP
stores every tensor by name with its global shape and re-slices on load: an FSDP run on
any number of ranks, a DDP run or a single process can continue from ``dcp/``; an FSDP
run continues from a one-process or DDP checkpoint (no ``dcp/``) by sharding its full
weights and optimiser state.

RNG: every rank seeds its generators with ``train.seed`` and no looplm forward draws
random numbers (data order comes from the stream's own seeded position), so all ranks'
generator states are identical by construction. ``trainer.pt`` keeps rank 0's, and every
rank restores it whatever the new world size: per-rank states would have no owner
after resharding 2 ranks onto 1 or 1 onto 2. Every save compares the ranks' torch
generator states (one small all-gather) and logs a warning if they ever differ.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from looplm.artifacts import (
    CONFIG_FILE,
    FORMAT_VERSION,
    LATEST,
    MODEL_FILE,
    CheckpointError,
    fsync_dir,
    load_tensors,
    load_weights,
    write_manifest,
    write_text,
)
from looplm.config_base import Config
from looplm.train.checkpoint import (
    FILES,
    TRAINER_FILE,
    Checkpoint,
    checkpoints_dir,
    commit_dir,
    prune_checkpoints,
    remove_leftovers,
    step_dir_name,
)

logger = logging.getLogger("looplm")

#: The DCP subdirectory of a sharded step directory.
DCP_DIR = "dcp"


def _aliases(model: nn.Module) -> dict[str, str]:
    """{state-dict name: the name safetensors keeps} for tensors registered under several
    names (a tied embedding/head): ``safetensors.torch.save_model`` keeps the
    alphabetically first, and ``load_model`` accepts a file holding one name per tensor."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    out = {}
    for group in names.values():
        kept = sorted(group)[0]
        out.update({name: kept for name in group if name != kept})
    return out


def save_sharded_checkpoint(
    out_dir: Any, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, run_config: Config,
    state: dict[str, Any], keep_last: Optional[int], rank: int,
) -> Path:
    """Write ``out_dir/checkpoints/step_{step:07d}/`` from every rank (collective: call it on
    all ranks) and return it; see the module docstring for the layout."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    root = checkpoints_dir(out_dir)
    name = step_dir_name(step)
    box: list[Optional[str]] = [None]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(root)
        box[0] = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root)
    dist.broadcast_object_list(box, src=0)  # every rank writes its shards into rank 0's temporary directory
    _check_rng_agrees(rank)
    tmp = Path(box[0])
    try:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp / DCP_DIR))
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            aliases = _aliases(model)
            save_file({k: v.contiguous() for k, v in full.items() if k not in aliases}, str(tmp / MODEL_FILE),
                      metadata=aliases or None)  # as safetensors.torch.save_model lays out a plain model
            write_text(tmp / CONFIG_FILE, json.dumps(run_config.to_dict(), indent=2) + "\n")
            torch.save({"format": FORMAT_VERSION, "step": step, "optimizer": None, **state}, tmp / TRAINER_FILE)
            shards = sorted(f"{DCP_DIR}/{p.name}" for p in (tmp / DCP_DIR).iterdir() if p.is_file())
            fsync_dir(tmp / DCP_DIR)
            write_manifest(tmp, (*FILES, *shards), step=step, sharded=True)
            fsync_dir(tmp)
            commit_dir(tmp, root / name)
        del full
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        write_text(root / LATEST, name + "\n", atomic=True)
        if keep_last is not None:
            prune_checkpoints(root, step, keep_last)
    dist.barrier()  # every rank returns once the checkpoint is complete
    return root / name


def _check_rng_agrees(rank: int) -> None:
    """Warn when the ranks' torch generators differ: the checkpoint keeps rank 0's (module
    docstring), so a forward that drew random numbers per rank would not resume exactly."""
    import torch.distributed as dist

    states: list[Optional[bytes]] = [None] * dist.get_world_size()
    dist.all_gather_object(states, hashlib.sha256(torch.get_rng_state().numpy().tobytes()).digest())
    if rank == 0 and len(set(states)) > 1:
        logger.warning("the ranks' torch RNG states differ; the checkpoint keeps rank 0's, so a resumed run's "
                       "random draws will not continue exactly on the other ranks")


def is_sharded_checkpoint(step_dir: Path) -> bool:
    return (Path(step_dir) / DCP_DIR).is_dir()


def restore_weights(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer, *, sharded: bool) -> None:
    """Load ``ckpt``'s weights and optimiser state into ``model`` (the plain or FSDP-sharded
    module, never its DDP wrapper) and ``optimizer``, whatever wrote it and whatever
    world size reads it. ``sharded``: ``model`` is FSDP-sharded. ``ckpt`` is verified
    already (:func:`looplm.train.checkpoint.load_checkpoint`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    if is_sharded_checkpoint(ckpt.path):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        model_state, optimizer_state = get_state_dict(model, optimizer)  # the layout to fill, this world size
        target = {"model": model_state, "optimizer": optimizer_state}
        single = not (dist.is_available() and dist.is_initialized())
        with warnings.catch_warnings():  # DCP warns that one process loads alone: here that is the intent
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(target, checkpoint_id=str(ckpt.path / DCP_DIR), no_dist=single)  # re-sliced from the shards
        set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
        return
    if ckpt.state.get("optimizer") is None:
        raise CheckpointError(f"checkpoint {ckpt.path} has no optimizer state")
    if not sharded:
        load_weights(model, ckpt.path / MODEL_FILE, device=str(next(model.parameters()).device))
        optimizer.load_state_dict(ckpt.state["optimizer"])
        return
    # A one-process or DDP checkpoint into FSDP: full tensors by name, sharded on this rank.
    weights = load_tensors(ckpt.path / MODEL_FILE)
    for name, kept in _aliases(model).items():
        weights.setdefault(name, weights.get(kept))
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=_by_name(ckpt.state["optimizer"]),
                   options=StateDictOptions(full_state_dict=True))


def _by_name(saved: dict[str, Any]) -> dict[str, Any]:
    """A ``torch.optim`` state dict (state keyed by position) keyed by parameter name
    instead, the layout ``set_state_dict`` reads; the names are those the optimiser
    recorded (:func:`looplm.train.optim.build_optimizer` gives every group ``param_names``)."""
    groups = saved["param_groups"]
    if any("param_names" not in g for g in groups):
        raise CheckpointError("the checkpoint's optimizer state has no parameter names, so it cannot be sharded")
    position = {i: n for g in groups for i, n in zip(g["params"], g["param_names"])}
    return {
        "state": {position[i]: s for i, s in saved["state"].items()},
        "param_groups": [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                          "params": list(g["param_names"])} for g in groups],
    }
