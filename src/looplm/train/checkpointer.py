"""Saving and restoring a trainer: the checkpoint part of :class:`~looplm.train.Trainer`.

A checkpoint holds the weights, the optimiser, and in ``trainer.pt`` the run's progress
(step, tokens, counters, losses, the data position, the RNG states) and the state of
every callback with a ``state_key`` (SGT growth's under ``growth``). Rank 0 writes it
(:func:`~looplm.train.checkpoint.save_checkpoint`); an FSDP run writes shards on every
rank (:mod:`looplm.train.sharded_checkpoint`), and either format restores into either
kind of run. Restoring sets the RNG states last, so that everything after it sees the
saved streams.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional, Union

from looplm.config_base import ConfigError
from looplm.train.checkpoint import (
    config_differences,
    has_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    with_defaults,
)
from looplm.train.callbacks import TrainerView
from looplm.train.config import TrainConfig
from looplm.train.sharded_checkpoint import restore_weights, save_sharded_checkpoint

logger = logging.getLogger("looplm")

#: Train-config fields that may differ on resume without changing what is computed.
RESUME_NEUTRAL = {"out_dir", "log_every", "eval_every", "save_every", "keep_last", "sample_prompt",
                  "sample_tokens", "sample_temperature", "compile", "device", "threads", "max_bad_steps", "loggers",
                  "wandb_project", "wandb_mode", "init_from",
                  "activation_checkpointing",  # recomputes the same values: exact either way
                  "parallel"}  # ddp and fsdp compute the same step; both read either checkpoint format
#: Data-config fields that may differ on resume: how shards are checked reads the same tokens.
DATA_RESUME_NEUTRAL = {"shard_check"}
#: trainer.pt's own keys (:func:`save_checkpoint`'s and :func:`trainer_state`'s), which no
#: callback's ``state_key`` may take, and the built-in callbacks' (SGT growth's).
RESERVED_STATE_KEYS = frozenset({
    "format", "step", "optimizer", "tokens_seen", "data", "rng", "bad_steps", "skipped_steps", "best_val_loss",
    "last_train_loss", "last_val_loss", "train_time_s", "world_size", "growth",
})


def resume_source(out_dir: Path, resume: Union[bool, str, os.PathLike, None]) -> Optional[Union[str, os.PathLike]]:
    """The checkpoint to continue from for the trainer's ``resume`` argument, or None for a
    fresh run (which refuses an ``out_dir`` that already holds checkpoints)."""
    if resume is False or resume is None:
        if has_checkpoints(out_dir):
            holds = "a directory without checkpoints for a fresh run: it already holds a run's checkpoints. "
            raise ConfigError(
                "train.out_dir", str(out_dir),
                holds + "Pass resume=True to continue that run, or choose another train.out_dir",
                cli_hint=holds + "Add --resume to continue that run, or choose another train.out_dir=DIR",
            )
        return None
    if resume is True:
        if (out_dir / "checkpoints" / "latest").is_file():
            return out_dir
        logger.warning("resume requested but %s has no checkpoint: starting a fresh run", out_dir)
        return None
    return resume


def trainer_state(trainer: TrainerView) -> dict[str, Any]:
    """What trainer.pt holds besides the optimiser (see :func:`save_checkpoint`)."""
    return {
        "tokens_seen": trainer.tokens_seen,
        "data": trainer.stream.state_dict(),
        "rng": rng_state(),
        "bad_steps": trainer.bad_steps,
        "skipped_steps": trainer.skipped_steps,
        "best_val_loss": trainer.best_val_loss,
        "last_train_loss": trainer.last_train_loss,
        "last_val_loss": trainer.last_val_loss,
        "train_time_s": trainer.train_time_s,
        "world_size": trainer.ranks.world_size,
        **{cb.state_key: cb.state_dict() for cb in trainer.callbacks if cb.state_key is not None},
    }


def save(trainer: TrainerView) -> Path:
    """Write a checkpoint of the trainer's step (rank 0; under FSDP every rank writes its
    shards) and wait for it on every rank."""
    tc, ranks = trainer.cfg.train, trainer.ranks
    path = trainer.out_dir / "checkpoints" / f"step_{trainer.step:07d}"
    if trainer.parallel == "fsdp":
        path = save_sharded_checkpoint(
            trainer.out_dir, step=trainer.step, model=trainer.model, optimizer=trainer.optimizer,
            run_config=trainer.cfg, state=trainer_state(trainer), keep_last=tc.keep_last, rank=ranks.rank,
        )
    elif ranks.is_main:
        path = save_checkpoint(
            trainer.out_dir, step=trainer.step, model=trainer.model, run_config=trainer.cfg,
            optimizer=trainer.optimizer, state=trainer_state(trainer), keep_last=tc.keep_last,
        )
    ranks.barrier()
    return path


def restore(trainer: TrainerView, source: Union[str, os.PathLike]) -> Path:
    """Load the checkpoint ``source`` into ``trainer`` (weights, optimiser, progress, data
    position, callback states, RNG states last); returns the checkpoint's path. Settings
    that differ from the checkpoint's (other than the resume-neutral ones) are reported."""
    cfg, tc = trainer.cfg, trainer.cfg.train
    ckpt = load_checkpoint(source, model_config=cfg.model)
    restore_weights(ckpt, trainer.model, trainer.optimizer, sharded=trainer.parallel == "fsdp")
    # The optimiser's groups come back with the saved hyper-parameters; the current
    # config is authoritative (differences are reported below). lr is set every step.
    for group, wd in zip(trainer.optimizer.param_groups, _group_weight_decays(tc)):
        group.update(weight_decay=wd, betas=(tc.beta1, tc.beta2), eps=tc.eps)
    saved_train = with_defaults(ckpt.config.get("train", {}), type(tc), "train")
    saved_train = {k: v for k, v in saved_train.items() if k not in RESUME_NEUTRAL}
    current_train = {k: v for k, v in tc.to_dict().items() if k not in RESUME_NEUTRAL}
    saved_world = int(ckpt.state.get("world_size", 1))
    if saved_train.get("batch_size", 0) * saved_world == tc.batch_size * trainer.ranks.world_size:
        # another world size with the same global batch: the same rows, split differently
        saved_train.pop("batch_size", None), current_train.pop("batch_size", None)
    saved_data = with_defaults(ckpt.config.get("data", {}), type(cfg.data), "data")
    saved_data = {k: v for k, v in saved_data.items() if k not in DATA_RESUME_NEUTRAL}
    current_data = {k: v for k, v in cfg.data.to_dict().items() if k not in DATA_RESUME_NEUTRAL}
    differences = config_differences(saved_data, current_data, "data")
    differences += config_differences(saved_train, current_train, "train")
    if differences:
        logger.warning(
            "resuming %s with settings that differ from the checkpoint's, so the run will not continue "
            "exactly as it would have:\n  %s", ckpt.path, "\n  ".join(differences),
        )
    s = ckpt.state
    trainer.stream.load_state_dict(s["data"])
    trainer.step, trainer.tokens_seen = ckpt.step, int(s["tokens_seen"])
    trainer.bad_steps, trainer.skipped_steps = int(s["bad_steps"]), int(s["skipped_steps"])
    trainer.best_val_loss, trainer.last_train_loss = s["best_val_loss"], s["last_train_loss"]
    trainer.last_val_loss, trainer.train_time_s = s["last_val_loss"], float(s["train_time_s"])
    for cb in trainer.callbacks:
        if cb.state_key is not None and cb.state_key in s:
            cb.load_state_dict(s[cb.state_key])
    set_rng_state(s["rng"])
    return ckpt.path


def _group_weight_decays(tc: TrainConfig) -> list[float]:
    return [tc.weight_decay, tc.weight_decay if tc.decay_norms_and_biases else 0.0]
