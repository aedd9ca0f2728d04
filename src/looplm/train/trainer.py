"""The training loop: one object that builds a run from a RunConfig and fits it.

Setup happens once, in ``Trainer.__init__``, in this order (torchtitan's shape: the model
code stays single-device; everything distributed or compiled is applied from outside):

1. seed Python and torch from ``train.seed``; pick the device (``auto``: CUDA if
   available, else CPU; ``cuda`` under torchrun means ``cuda:$LOCAL_RANK``);
2. build the tokenizer and check it fits ``model.vocab_size``; build ``LoopLM`` (and load
   ``train.init_from``);
3. wrap for execution (:meth:`Trainer._wrap`): activation checkpointing as
   ``train.activation_checkpointing`` says (:mod:`looplm.train.activation_checkpointing`, in place
   through the model's ``recompute`` seam, inert in ``no_grad`` forwards), then the
   data-parallel wrapper of ``train.parallel`` when a process group is initialised
   (``DistributedDataParallel``, or FSDP2's ``fully_shard`` in place,
   :mod:`looplm.train.fsdp`), then ``torch.compile`` when ``train.compile`` (compiling
   the DDP module lets Dynamo's DDP optimiser split graphs at gradient-bucket boundaries);
4. build the AdamW optimiser (:func:`~looplm.train.optim.build_optimizer`) over the
   parameters as wrapped (FSDP2's are the sharded ones), the training stream (sharded
   by the torch.distributed rank when a process group is initialised) and the validation
   batches; for ``data.source=task:NAME`` the task's own tokenizer and stream, and a
   :class:`~looplm.tasks.TaskEvaluator` that logs ``task_eval`` metrics at every
   evaluation and advances the state-tracking curriculum;
5. restore a checkpoint when resuming (weights, optimiser, step, data position, counters,
   and the RNG states last, so that everything after it sees the saved streams); a
   sharded checkpoint of an FSDP run, or a full one into an FSDP run, goes through
   :mod:`looplm.train.sharded_checkpoint`, on any number of ranks.

Checkpoints, evaluation, sampling and parameter counts use ``self.model``: the plain
model, or under FSDP the same object sharded in place (its forwards are collective, so
under FSDP every rank evaluates and samples, and saving is collective).

Precision: ``auto`` is bf16 autocast on a CUDA device that supports bf16 and fp32
otherwise; ``bf16`` forces bf16 autocast, on CPU too (CPU autocast: slow, meant for
checking bf16 numerics without a GPU); ``fp32`` disables autocast. Weights, optimiser
state and the loss reduction stay fp32 in every mode.

One optimiser step: ``train.batch_size`` sequences per rank, in ``train.grad_accum``
micro-batches whose losses are scaled by ``1 / grad_accum``; the learning rate is
``lr_at(step)``; gradients are clipped to ``train.grad_clip`` (0: measured, not clipped). A
step whose mean loss or gradient norm is not finite is skipped (gradients dropped, no
update; it still counts as a step and consumes its batch) and logged; ``train.max_bad_steps``
consecutive skipped steps stop the run with :class:`~looplm.errors.TrainingDiverged`. A step
reads nothing back: the fused AdamW kernel skips a non-finite step on the device
(``found_inf``), and ``fit`` reads the steps' losses and norms in one host sync at each log,
evaluation and checkpoint step (sharded DTensor parameters, whose foreach kernels cannot
skip on the device, read once per step).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from looplm.config_base import ConfigError
from looplm.errors import TrainingDiverged
from looplm.data import data_tokenizer, train_stream, validation_batches
from looplm.head_loop.training import Growth
from looplm.model import LoopLM
from looplm.eval.tasks import task_evaluator
from looplm.tasks.config import is_task_source
from looplm.train.checkpoint import (
    config_differences,
    has_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    with_defaults,
)
from looplm.train.activation_checkpointing import apply_activation_checkpointing
from looplm.train.config import TrainConfig
from looplm.train.metrics import MetricsWriter, format_summary, json_safe, perplexity
from looplm.train.optim import build_optimizer
from looplm.train.params import parameter_counts
from looplm.train.schedule import lr_at
from looplm.train.sharded_checkpoint import restore_weights, save_sharded_checkpoint
from looplm.train.trackers import build_trackers

if TYPE_CHECKING:  # looplm.config imports looplm.train.config, so a runtime import here would be circular
    from looplm.config import RunConfig

logger = logging.getLogger("looplm")

#: Train-config fields that may differ on resume without changing what is computed.
_RESUME_NEUTRAL = {"out_dir", "log_every", "eval_every", "save_every", "keep_last", "sample_prompt",
                   "sample_tokens", "sample_temperature", "compile", "device", "threads", "max_bad_steps", "loggers",
                   "wandb_project", "wandb_mode", "init_from",
                   "activation_checkpointing",  # recomputes the same values: exact either way
                   "parallel"}  # ddp and fsdp compute the same step; both read either checkpoint format
#: Data-config fields that may differ on resume: how shards are checked reads the same tokens.
_DATA_RESUME_NEUTRAL = {"shard_check"}


class Trainer:
    """Trains ``LoopLM(run_cfg.model)`` on ``run_cfg.data`` as ``run_cfg.train`` says.

    resume: ``False`` starts a fresh run and refuses an ``out_dir`` that already holds
    checkpoints; ``True`` continues from ``out_dir``'s latest checkpoint, or starts fresh
    (with a warning) when there is none, so a pre-emptible job can always pass it; a path
    (run, checkpoints or step directory) continues from that checkpoint, which must exist.
    progress: show a tqdm bar on stderr (rank 0 only).

    Under ``torchrun`` initialise the process group before constructing the Trainer; rank
    0 writes checkpoints, metrics and the summary, and every rank reads checkpoints from
    ``out_dir`` (a shared file system).
    """

    def __init__(self, run_cfg: RunConfig, *, resume: Union[bool, str, os.PathLike] = False, progress: bool = True):
        self.cfg = run_cfg
        tc = run_cfg.train
        self.out_dir = Path(tc.out_dir)
        self.progress = progress
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if self.distributed else (0, 1)
        if self.rank == 0:
            _console_logging()
            _check_writable(self.out_dir)  # before any work: a run that cannot save would be lost
        self.device = _pick_device(tc.device, self.distributed)
        if tc.threads is not None:  # process-wide; resume-neutral: speed, not what is computed
            torch.set_num_threads(tc.threads)
        self.autocast_dtype = _autocast_dtype(tc.precision, self.device)
        _seed_everything(tc.seed)

        self.tokenizer = data_tokenizer(run_cfg.data)  # a task source brings its own vocabulary
        if run_cfg.model.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                "model.vocab_size", run_cfg.model.vocab_size,
                f"an integer >= {self.tokenizer.vocab_size}, the vocabulary size of tokenizer "
                f"{self.tokenizer.name!r} (data.tokenizer)",
            )
        if run_cfg.data.seq_len > run_cfg.model.max_seq_len:
            raise ConfigError(
                "data.seq_len", run_cfg.data.seq_len, f"at most model.max_seq_len={run_cfg.model.max_seq_len}"
            )
        self.model = self._build_model().to(self.device)
        # SGT (model.head_loop): entropy measured in training forwards, growth decided per step
        self.growth = Growth(self.model, self.device) if run_cfg.model.head_loop is not None else None
        source = self._checkpoint_to_resume(resume)
        if tc.init_from is not None:
            if source is not None:
                raise ConfigError("train.init_from", tc.init_from,
                                  "null when resuming: the checkpoint already holds the weights")
            _load_initial_weights(self.model, tc.init_from, run_cfg.model, self.device)
        self.parallel = _parallel_mode(tc.parallel, self.distributed, run_cfg.data.source)
        self.train_model = self._wrap(self.model)  # FSDP shards in place: before the optimiser
        self.optimizer = build_optimizer(self.model, tc)
        if self.growth is not None:  # SGT's head arrangement moves the optimiser state with the weights
            self.growth.optimizer = self.optimizer
        self.stream = train_stream(run_cfg.data, self.tokenizer, tc.batch_size, self.rank, self.world_size)
        # Task sources (data.source=task:NAME): task metrics at each evaluation, curriculum included.
        self.task_eval = task_evaluator(run_cfg, self.stream, self.rank, self.world_size)
        self.micro_batch = tc.batch_size // tc.grad_accum
        self.val_batches = validation_batches(
            run_cfg.data, self.tokenizer, self.micro_batch, self.rank, self.world_size
        )
        if not self.val_batches and self.task_eval is None and run_cfg.data.val_fraction > 0 and run_cfg.data.val_batches:
            logger.warning(
                "no validation set: the held-out split of %r (data.val_fraction=%g) has no window of data.seq_len + 1 "
                "= %d tokens, so val_loss will be missing; use more data, a shorter data.seq_len or a larger "
                "data.val_fraction", run_cfg.data.source, run_cfg.data.val_fraction, run_cfg.data.seq_len + 1,
            )
        self.tokens_per_step = tc.batch_size * run_cfg.data.seq_len * self.world_size

        # Progress; everything here is saved in trainer.pt and restored on resume.
        self.step = 0
        self.tokens_seen = 0
        self.bad_steps = 0  # consecutive skipped steps
        self.last_aux: dict[str, float] = {}  # the last step's auxiliary losses (logged as aux_NAME)
        self.skipped_steps = 0
        self.best_val_loss: Optional[float] = None
        self.last_train_loss: Optional[float] = None
        self.last_val_loss: Optional[float] = None
        self.train_time_s = 0.0

        self.resumed_from: Optional[Path] = None
        self.last_saved_step: Optional[int] = None
        self.last_eval_step: Optional[int] = None
        self.last_checkpoint: Optional[Path] = None
        if source is not None:
            self._restore(source)

        metrics_path = self.out_dir / "metrics.jsonl"
        if self.rank == 0 and self.resumed_from is None and metrics_path.exists():
            logger.warning("%s has no checkpoint; its metrics.jsonl is replaced by this fresh run's", self.out_dir)
        trackers = build_trackers(tc.loggers, self.out_dir, wandb_project=tc.wandb_project, wandb_mode=tc.wandb_mode,
                                  config=run_cfg.to_dict()) if self.rank == 0 else []
        self.metrics = MetricsWriter(metrics_path if self.rank == 0 else None, fresh=self.resumed_from is None,
                                     trackers=trackers)
        if self.resumed_from is None:
            self.metrics.log("start", 0, parameters=parameter_counts(self.model), world_size=self.world_size,
                             device=str(self.device))
        else:
            self.metrics.log("resume", self.step, checkpoint=str(self.resumed_from), world_size=self.world_size)
            logger.info("resumed from %s at step %d", self.resumed_from, self.step)

    # ------------------------------------------------------------------ setup
    def _checkpoint_to_resume(self, resume: Union[bool, str, os.PathLike]) -> Optional[Union[str, os.PathLike]]:
        if resume is False or resume is None:
            if has_checkpoints(self.out_dir):
                holds = "a directory without checkpoints for a fresh run: it already holds a run's checkpoints. "
                raise ConfigError(
                    "train.out_dir", str(self.out_dir),
                    holds + "Pass resume=True to continue that run, or choose another train.out_dir",
                    cli_hint=holds + "Add --resume to continue that run, or choose another train.out_dir=DIR",
                )
            return None
        if resume is True:
            if (self.out_dir / "checkpoints" / "latest").is_file():
                return self.out_dir
            logger.warning("resume requested but %s has no checkpoint: starting a fresh run", self.out_dir)
            return None
        return resume

    def _restore(self, source: Union[str, os.PathLike]) -> None:
        ckpt = load_checkpoint(source, model_config=self.cfg.model)
        restore_weights(ckpt, self.model, self.optimizer, sharded=self.parallel == "fsdp")
        tc = self.cfg.train
        # The optimiser's groups come back with the saved hyper-parameters; the current
        # config is authoritative (differences are reported below). lr is set every step.
        for group, wd in zip(self.optimizer.param_groups, _group_weight_decays(tc)):
            group.update(weight_decay=wd, betas=(tc.beta1, tc.beta2), eps=tc.eps)
        saved_train = with_defaults(ckpt.config.get("train", {}), type(tc), "train")
        saved_train = {k: v for k, v in saved_train.items() if k not in _RESUME_NEUTRAL}
        current_train = {k: v for k, v in tc.to_dict().items() if k not in _RESUME_NEUTRAL}
        saved_world = int(ckpt.state.get("world_size", 1))
        if saved_train.get("batch_size", 0) * saved_world == tc.batch_size * self.world_size:
            # another world size with the same global batch: the same rows, split differently
            saved_train.pop("batch_size", None), current_train.pop("batch_size", None)
        saved_data = with_defaults(ckpt.config.get("data", {}), type(self.cfg.data), "data")
        saved_data = {k: v for k, v in saved_data.items() if k not in _DATA_RESUME_NEUTRAL}
        current_data = {k: v for k, v in self.cfg.data.to_dict().items() if k not in _DATA_RESUME_NEUTRAL}
        differences = config_differences(saved_data, current_data, "data")
        differences += config_differences(saved_train, current_train, "train")
        if differences:
            logger.warning(
                "resuming %s with settings that differ from the checkpoint's, so the run will not continue "
                "exactly as it would have:\n  %s", ckpt.path, "\n  ".join(differences),
            )
        s = ckpt.state
        self.stream.load_state_dict(s["data"])
        self.step, self.tokens_seen = ckpt.step, int(s["tokens_seen"])
        self.bad_steps, self.skipped_steps = int(s["bad_steps"]), int(s["skipped_steps"])
        self.best_val_loss, self.last_train_loss = s["best_val_loss"], s["last_train_loss"]
        self.last_val_loss, self.train_time_s = s["last_val_loss"], float(s["train_time_s"])
        if self.growth is not None:
            self.growth.load_state_dict(s["growth"], self.step)
        set_rng_state(s["rng"])
        self.resumed_from = self.last_checkpoint = ckpt.path
        self.last_saved_step = ckpt.step

    def _build_model(self) -> LoopLM:
        """The model to train, before a checkpoint is restored into it (a hook: distillation
        builds its student from a teacher, :mod:`looplm.distill`)."""
        return LoopLM(self.cfg.model)

    def _forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss to minimise, named auxiliary losses) of one micro-batch [B, T]; a hook for
        objectives other than next-token cross-entropy (:mod:`looplm.distill`)."""
        out = self.train_model(inputs, targets)
        return out.loss, out.aux_losses

    def _wrap(self, model: LoopLM) -> nn.Module:
        tc = self.cfg.train
        apply_activation_checkpointing(model, tc.activation_checkpointing)
        wrapped: nn.Module = model
        if self.parallel == "fsdp":
            from looplm.train.fsdp import apply_fsdp

            apply_fsdp(model, fsdp_precision=tc.fsdp_precision, autocast_dtype=self.autocast_dtype,
                       world_size=self.world_size)
        elif self.parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DistributedDataParallel(model, device_ids=ids)
        mode = self.cfg.train.compile
        if mode:
            wrapped = torch.compile(wrapped, **({} if mode is True else {"mode": mode}))
        return wrapped

    def _state(self) -> dict[str, Any]:
        """What trainer.pt holds besides the optimiser (see :func:`save_checkpoint`)."""
        return {
            "tokens_seen": self.tokens_seen,
            "data": self.stream.state_dict(),
            "rng": rng_state(),
            "bad_steps": self.bad_steps,
            "skipped_steps": self.skipped_steps,
            "best_val_loss": self.best_val_loss,
            "last_train_loss": self.last_train_loss,
            "last_val_loss": self.last_val_loss,
            "train_time_s": self.train_time_s,
            "world_size": self.world_size,
            **({"growth": self.growth.state_dict()} if self.growth is not None else {}),
        }

    # ------------------------------------------------------------------ the loop
    def fit(self, stop_after: Optional[int] = None) -> dict[str, Any]:
        """Train to ``train.max_steps`` (or stop after step ``stop_after``, as a pre-empted
        job would: the schedule still runs to max_steps), evaluate, save a checkpoint,
        generate a sample, write ``summary.json`` and return the summary."""
        tc = self.cfg.train
        end = tc.max_steps if stop_after is None else min(stop_after, tc.max_steps)
        wall_start = time.perf_counter()
        session_tokens, session_time = 0, 0.0
        window_tokens, window_time = 0, 0.0
        bar = _progress_bar(total=tc.max_steps, initial=self.step, enabled=self.progress and self.rank == 0)
        try:
            with _redirect_logging(bar):
                pending: list[torch.Tensor] = []  # the values of the steps not read back yet
                while self.step < end:
                    lr = lr_at(self.step, tc)
                    t0 = time.perf_counter()
                    values, names = self._train_step(lr)
                    elapsed = time.perf_counter() - t0
                    pending.append(values)
                    self.step += 1
                    self.tokens_seen += self.tokens_per_step
                    bar.update(1)
                    if self.growth is not None:
                        self._grow()
                    logged = self.step % tc.log_every == 0 or self.step == end
                    evaluated = bool(tc.eval_every) and self.step % tc.eval_every == 0
                    saved = bool(tc.save_every) and self.step % tc.save_every == 0
                    read = None
                    if logged or evaluated or saved:  # the steps since the last read, in one host sync
                        t1 = time.perf_counter()
                        read = self._read_back(pending)
                        pending.clear()
                        elapsed += time.perf_counter() - t1  # the device's time, waited for here
                    self.train_time_s += elapsed
                    session_tokens, session_time = session_tokens + self.tokens_per_step, session_time + elapsed
                    window_tokens, window_time = window_tokens + self.tokens_per_step, window_time + elapsed
                    if read is None:
                        continue
                    loss, grad_norm, *aux = read
                    self.last_aux = dict(zip(names, aux))
                    if logged and math.isfinite(loss) and math.isfinite(grad_norm):
                        tps = window_tokens / window_time if window_time > 0 else 0.0
                        mfu = self._model_flops(tps)["mfu"]  # None where the peak is unknown (CPU)
                        self.metrics.log("train", self.step, loss=loss, lr=lr, grad_norm=grad_norm,
                                         tokens=self.tokens_seen, tokens_per_s=tps,
                                         **({} if mfu is None else {"mfu": mfu}),
                                         **{f"aux_{k}": v for k, v in self.last_aux.items()})
                        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", refresh=False)
                        window_tokens, window_time = 0, 0.0
                    if evaluated:
                        self.evaluate()
                    if saved:
                        self.save()
                if self.last_eval_step != self.step:
                    self.evaluate()
                if self.last_saved_step != self.step:
                    self.save()
        except BaseException:
            self.metrics.close()
            raise
        finally:
            bar.close()
        # sharded forwards are collective: under FSDP every rank samples (the same tokens)
        sample = self.sample() if self.rank == 0 or self.parallel == "fsdp" else None
        summary = self._summary(
            tokens_per_s=session_tokens / session_time if session_time > 0 else None,
            wall_time_s=time.perf_counter() - wall_start,
            sample=sample,
        )
        if self.rank == 0:
            _write_json(self.out_dir / "summary.json", summary)
            logger.info("run summary\n%s", format_summary(summary))
            if summary["model_flops_per_token"] is not None:
                mfu = summary["mfu"]
                logger.info("model FLOPs/token %.4g (training, default convention)%s", summary["model_flops_per_token"],
                            "" if mfu is None else f", MFU {100 * mfu:.1f}%")
            if sample is not None:
                logger.info("sample (%d tokens, temperature %g):\n%s", tc.sample_tokens, tc.sample_temperature, sample)
        if self.step >= tc.max_steps:  # finished: trackers flush and close (a fit stopped early may continue)
            self.metrics.close()
        return summary

    def train_step(self) -> tuple[float, float]:
        """One optimiser step on the next batch at the schedule's learning rate, without
        :meth:`fit`'s bookkeeping (the step counter, logging, SGT growth, evaluation and
        checkpoints stay as they are): the step benchmarks/train_throughput.py times.
        Returns (mean loss, gradient norm)."""
        values, names = self._train_step(lr_at(self.step, self.cfg.train))
        loss, grad_norm, *aux = values.tolist()  # reads the step back: synchronises the device
        self.last_aux = dict(zip(names, aux))
        return loss, grad_norm

    def _train_step(self, lr: float) -> tuple[torch.Tensor, tuple[str, ...]]:
        """One optimiser step at learning rate ``lr``. Returns, still on the device, the
        values [loss, gradient norm, auxiliary losses...] (means over micro-batches and
        ranks) and the auxiliary losses' names: nothing is read back here. A step whose loss
        or gradient norm is not finite applies no update: on the device with the fused AdamW
        kernel (``found_inf``), else after one host read."""
        tc = self.cfg.train
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = next(self.stream)
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        loss_sum = torch.zeros((), device=self.device)
        aux_sum: dict[str, torch.Tensor] = {}
        for i in range(tc.grad_accum):
            rows = slice(i * self.micro_batch, (i + 1) * self.micro_batch)
            last = i == tc.grad_accum - 1
            if self.cfg.train.compile in ("reduce-overhead", "max-autotune"):
                torch.compiler.cudagraph_mark_step_begin()  # a new replay: the last one's outputs are consumed
            with self._gradient_sync(last):  # DDP all-reduces only on the last micro-batch
                with self._autocast():
                    loss, aux = self._forward_loss(inputs[rows], targets[rows])
                (loss / tc.grad_accum).backward()
            loss_sum += loss.detach().float()
            for name, value in aux.items():
                aux_sum[name] = aux_sum.get(name, 0.0) + value.detach().float()
        # the loss and its auxiliary terms (ponder cost, Q-halt BCE, DSA indexer), averaged
        # over micro-batches and ranks in one reduction
        means = torch.stack([loss_sum, *aux_sum.values()]) / tc.grad_accum
        if self.distributed:
            dist.all_reduce(means)
            means /= self.world_size
        # max_norm=inf measures without clipping (clip coefficient clamps to exactly 1)
        max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if self.parallel == "fsdp":  # a DTensor over the sharded gradients
            grad_norm = grad_norm.full_tensor()
        values = torch.cat([means[:1].float(), grad_norm.float().view(1), means[1:].float()])
        if all(group.get("fused") for group in self.optimizer.param_groups):  # skipped on the device: no host sync
            self.optimizer.found_inf = (~torch.isfinite(values[:2]).all()).float()
            self.optimizer.step()
        elif all(math.isfinite(v) for v in values[:2].tolist()):  # one host read (sharded parameters)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return values, tuple(aux_sum)


    def _grow(self) -> None:
        """SGT: this step's entropies into the EMA, a decision when due, every event logged."""
        for event in self.growth.after_step(self.step, self.distributed):
            self.metrics.log("growth", self.step, **{k: v for k, v in event.items() if k != "step"})
            if event["action"] != "hold":
                self.__dict__.pop("_flops_per_token", None)  # the structure changed: recount
                logger.info("growth at step %d: %s %s (depth %s, heads %s)", self.step, event["action"],
                            event["block"], event["depth"], event["heads"])

    def _read_back(self, pending: list[torch.Tensor]) -> list[float]:
        """Read the values of the steps ``pending`` (ending at ``self.step``) in one host
        sync: a non-finite one is reported as skipped (:meth:`_on_bad_step`), a finite one
        resets the count. Returns the last step's values [loss, grad_norm, aux...]."""
        flat = torch.cat([*(v[:2] for v in pending), pending[-1]]).tolist()
        first, n = self.step - len(pending) + 1, len(pending)
        for i in range(n):
            loss, grad_norm = flat[2 * i], flat[2 * i + 1]
            if math.isfinite(loss) and math.isfinite(grad_norm):
                self.bad_steps, self.last_train_loss = 0, loss
            else:
                self._on_bad_step(first + i, loss, grad_norm)
        return flat[2 * n:]

    def _on_bad_step(self, step: int, loss: float, grad_norm: float) -> None:
        """Step ``step`` applied no update (non-finite loss or gradient norm); read back at
        the next log, evaluation or checkpoint, so the run stops at most train.log_every
        steps after the limit is reached (those steps too apply no update while non-finite)."""
        self.bad_steps += 1
        self.skipped_steps += 1
        limit = self.cfg.train.max_bad_steps
        self.metrics.log("skipped", step, loss=loss, grad_norm=grad_norm, bad_steps=self.bad_steps)
        logger.warning(
            "step %d skipped: non-finite loss=%s or grad_norm=%s (%d consecutive, limit train.max_bad_steps=%d)",
            step, loss, grad_norm, self.bad_steps, limit,
        )
        if self.bad_steps >= limit:
            last = "no checkpoint was saved"
            if self.last_checkpoint is not None:
                last = f"the last checkpoint is {self.last_checkpoint}"
            raise TrainingDiverged(
                f"training stopped at step {self.step}: {self.bad_steps} consecutive steps "
                f"({step - self.bad_steps + 1}..{step}) had a non-finite loss or gradient norm "
                f"(last: loss={loss}, grad_norm={grad_norm}), so no update was applied; {last}. The run is "
                f"diverging: try a lower train.lr (now {self.cfg.train.lr:g}), a smaller train.grad_clip "
                f"(now {self.cfg.train.grad_clip:g}), a longer warmup or train.precision=fp32, and resume "
                f"from the checkpoint"
            )

    def _gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        # FSDP reduce-scatters every micro-batch: accumulating unsharded gradients would
        # undo the sharding's memory saving
        if self.parallel == "ddp" and not enabled:
            return self._ddp_module().no_sync()
        return contextlib.nullcontext()

    def _ddp_module(self) -> nn.Module:
        module = self.train_model
        return getattr(module, "_orig_mod", module)  # torch.compile's wrapper keeps the DDP module here

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ evaluation, saving, sampling
    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        """Mean loss over the validation batches (all ranks); logs ``val_loss`` and ``val_ppl``.
        None when the data has no validation split. Batches have the micro-batch size
        (``batch_size / grad_accum``), the size known to fit in memory."""
        self.last_eval_step = self.step
        if self.task_eval is not None:
            with self._autocast():
                self.metrics.log("task_eval", self.step, **self.task_eval.evaluate(self.model, self.step))
        if not self.val_batches:
            return None
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for inputs, targets in self.val_batches:
            with self._autocast():
                total += self.model(inputs.to(self.device), targets.to(self.device)).lm_loss.float()
        self.model.train()
        mean = total / len(self.val_batches)  # equal-size batches without padding: the token mean
        if self.distributed:
            dist.all_reduce(mean)
            mean /= self.world_size
        val_loss = mean.item()
        self.last_val_loss = val_loss
        if math.isfinite(val_loss) and (self.best_val_loss is None or val_loss < self.best_val_loss):
            self.best_val_loss = val_loss
        self.metrics.log("eval", self.step, val_loss=val_loss, val_ppl=perplexity(val_loss))
        return val_loss

    def save(self) -> Path:
        """Write a checkpoint of the current step (rank 0; under FSDP every rank writes its
        shards) and wait for it on every rank."""
        path = self.out_dir / "checkpoints" / f"step_{self.step:07d}"
        if self.parallel == "fsdp":
            path = save_sharded_checkpoint(
                self.out_dir, step=self.step, model=self.model, optimizer=self.optimizer, run_config=self.cfg,
                state=self._state(), keep_last=self.cfg.train.keep_last, rank=self.rank,
            )
        elif self.rank == 0:
            path = save_checkpoint(
                self.out_dir, step=self.step, model=self.model, run_config=self.cfg,
                optimizer=self.optimizer, state=self._state(), keep_last=self.cfg.train.keep_last,
            )
        if self.distributed:
            dist.barrier()
        self.last_saved_step, self.last_checkpoint = self.step, path
        return path

    @torch.no_grad()
    def sample(self) -> Optional[str]:
        """``train.sample_prompt`` continued by up to ``train.sample_tokens`` tokens (seeded by
        ``train.seed``), or None when sampling is off."""
        tc = self.cfg.train
        if tc.sample_tokens == 0:
            return None
        if self.task_eval is not None:  # a greedy answer to one evaluation problem
            with self._autocast():
                return self.task_eval.sample(self.model)
        ids = self.tokenizer.encode(tc.sample_prompt) or [self.tokenizer.eos_id]
        new = min(tc.sample_tokens, self.cfg.model.max_seq_len - len(ids))
        if new <= 0:
            logger.warning("no sample: the prompt fills model.max_seq_len=%d", self.cfg.model.max_seq_len)
            return None
        generator = torch.Generator(device=self.device).manual_seed(tc.seed)
        self.model.eval()
        try:
            with self._autocast():
                out = self.model.generate(
                    torch.tensor([ids], device=self.device),
                    max_new_tokens=new,
                    temperature=tc.sample_temperature,  # 0: greedy
                    stop_tokens=(self.tokenizer.eos_id,),
                    pad_token_id=self.tokenizer.pad_id,
                    generator=generator,
                )
        finally:
            self.model.train()
        return tc.sample_prompt + self.tokenizer.decode(out.new_tokens[0])

    def _summary(self, *, tokens_per_s: Optional[float], wall_time_s: float, sample: Optional[str]) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "out_dir": str(self.out_dir),
            "steps": self.step,
            "max_steps": cfg.train.max_steps,
            "skipped_steps": self.skipped_steps,
            "parameters": parameter_counts(self.model),
            "layout": cfg.model.layout,
            "unrolled_depth": cfg.model.parsed_layout.unrolled_depth,
            "tokens_seen": self.tokens_seen,
            "train_loss": self.last_train_loss,
            "train_ppl": None if self.last_train_loss is None else perplexity(self.last_train_loss),
            "val_loss": self.last_val_loss,
            "val_ppl": None if self.last_val_loss is None else perplexity(self.last_val_loss),
            "best_val_loss": self.best_val_loss,
            "tokens_per_s": tokens_per_s,
            **self._model_flops(tokens_per_s),
            "wall_time_s": wall_time_s,
            "train_time_s": self.train_time_s,
            "device": str(self.device),
            "precision": "fp32" if self.autocast_dtype is None else "bf16",
            "world_size": self.world_size,
            "checkpoint": None if self.last_checkpoint is None else str(self.last_checkpoint),
            "resumed_from": None if self.resumed_from is None else str(self.resumed_from),
            "sample": sample,
            "task": None if self.task_eval is None else self.task_eval.last,  # last task_eval record (n_max, ...)
            "config": cfg.to_dict(),
        }


    @functools.cached_property
    def _flops_per_token(self) -> Optional[float]:
        """Training FLOPs per token over the unrolled computation (looplm.accounting,
        ``default`` convention); None for a mechanism without a FLOP rule. Counted once, and
        again after each SGT growth event from the model itself (its loops are the grown ones)."""
        from looplm.accounting import count_flops

        try:
            subject = self.model if self.growth is not None else self.cfg.model
            return count_flops(subject, self.cfg.data.seq_len).training_per_token
        except Exception as err:  # a mechanism without a FLOP rule yet: report none, never fail the run
            logger.warning("model FLOPs not counted: %s", err)
            return None

    def _model_flops(self, tokens_per_s: Optional[float]) -> dict[str, Any]:
        """Model FLOPs per token and MFU against the device's peak (None where unknown)."""
        from looplm.accounting import device_peak_flops, mfu

        per_token = self._flops_per_token
        if per_token is None:
            return {"model_flops_per_token": None, "mfu": None}
        peak = device_peak_flops(self.device, self.autocast_dtype or torch.float32)
        return {"model_flops_per_token": per_token,
                "mfu": None if tokens_per_s is None else mfu(per_token, tokens_per_s, peak, self.world_size)}


# ---------------------------------------------------------------------- helpers
def _console_logging() -> None:
    """Show looplm's log lines (progress notes, the summary, warnings) on stderr when the
    program configured no logging at all, as a script or notebook using the Python API
    usually has not; a configured program (the CLI, pytest, an application) is left alone."""
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _load_initial_weights(model: nn.Module, path: str, model_cfg: Any, device: torch.device) -> None:
    """train.init_from: copy the weights of a save_pretrained directory or checkpoint (verified
    against its manifest) into ``model``; a different model config is refused, fields named."""
    from looplm.artifacts import MODEL_FILE, load_weights, read_weights_dir

    directory, config = read_weights_dir(path)
    saved = with_defaults(config["model"] if "model" in config else config, type(model_cfg), "model")
    differences = config_differences(saved, model_cfg.to_dict(), "model")
    if differences:
        raise ConfigError("train.init_from", path, "weights of this run's model config; they differ in:\n  "
                          + "\n  ".join(differences))
    load_weights(model, directory / MODEL_FILE, device=str(device))
    logger.info("initialised the weights from %s", directory)


def _check_writable(out_dir: Path) -> None:
    """Create ``out_dir`` and its ``checkpoints/`` and prove that files can be written in
    both, or raise a ConfigError naming the directory."""
    for directory in (out_dir, out_dir / "checkpoints"):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".tmp-write-check-"):
                pass
        except OSError as err:
            raise ConfigError(
                "train.out_dir", str(out_dir),
                f"a directory this process can write to: {directory} is not writable ({err.strerror or err})",
            ) from None


def _parallel_mode(parallel: str, distributed: bool, source: str) -> str:
    """``none``, ``ddp`` or ``fsdp`` for ``train.parallel`` (``auto``: ddp when distributed)."""
    if parallel == "auto":
        return "ddp" if distributed else "none"
    if not distributed:
        raise ConfigError("train.parallel", parallel,
                          f"auto in a single process: {parallel} needs several processes; launch with torchrun "
                          "--nproc_per_node=N (N >= 2)")
    if parallel == "fsdp" and is_task_source(source):
        raise ConfigError("train.parallel", parallel, "auto or ddp with data.source=task:NAME: task evaluation "
                          "generates a different number of tokens on each rank, which sharded (collective) "
                          "forwards cannot do; these models are small enough to replicate")
    return parallel


def _pick_device(spec: str, distributed: bool) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError("train.device", spec, "auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device", spec, "auto or cpu: CUDA is not available on this machine")
        if device.index is None:
            index = int(os.environ.get("LOCAL_RANK", 0)) if distributed else torch.cuda.current_device()
            device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    return device


def _autocast_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    """bf16 or None (fp32) for ``train.precision`` on ``device``; see the module docstring."""
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "fp32":
        return None
    if precision == "bf16":
        if device.type == "cuda" and not cuda_bf16:
            raise ConfigError("train.precision", precision, "fp32 or auto: this GPU does not support bf16")
        return torch.bfloat16
    return torch.bfloat16 if cuda_bf16 else None


def _group_weight_decays(tc: TrainConfig) -> list[float]:
    return [tc.weight_decay, tc.weight_decay if tc.decay_norms_and_biases else 0.0]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # every device's generator, CUDA included


def _progress_bar(*, total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr,
                disable=not enabled, dynamic_ncols=True)


@contextlib.contextmanager
def _redirect_logging(bar) -> Iterator[None]:
    """Route console log records through tqdm while the bar is shown, so they do not tear it."""
    if bar.disable:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[logging.getLogger(), logger]):
        yield


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write through a temporary file and os.replace, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(json_safe(data), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
