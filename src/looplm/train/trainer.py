"""The training loop: a short loop over parts with public seams (torchtitan's shape).

The parts, each in its own module:

* the objective: ``loss_fn(model, inputs, targets, step) -> (loss, aux)``
  (:mod:`looplm.train.callbacks`; the model's own loss by default), and the model from
  ``model_factory(model_config)`` (:class:`LoopLM` by default): distillation hands in a
  student factory and its KD losses (:mod:`looplm.distill.stages`);
* callbacks (:class:`~looplm.train.callbacks.Callback`): SGT growth
  (:mod:`looplm.train.growth`), task evaluation (:mod:`looplm.train.task_eval`), the
  validation loss (:mod:`looplm.train.validation`), and any passed in;
* checkpoints, save and resume, sharded included (:mod:`looplm.train.checkpointer`);
* throughput, model FLOPs and MFU (:mod:`looplm.train.throughput`), the records
  (:mod:`looplm.train.metrics`); the rank of this process (:class:`~looplm.train.distributed.Ranks`).

Setup happens once, in ``Trainer.__init__``, in this order (the model code stays
single-device; everything distributed or compiled is applied from outside):

1. seed Python and torch from ``train.seed``; pick the device (``auto``: CUDA if
   available, else CPU; ``cuda`` under torchrun means ``cuda:$LOCAL_RANK``);
2. build the tokenizer and check it fits ``model.vocab_size``; build the model with
   ``model_factory`` (and load ``train.init_from``); SGT's growth callback places its
   entropy hooks;
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
   batches; for ``data.source=task:NAME`` the task's own tokenizer and stream, and the
   task-evaluation callback;
5. restore a checkpoint when resuming (weights, optimiser, step, data position, counters,
   the callbacks' states, and the RNG states last, so that everything after it sees the
   saved streams); a sharded checkpoint of an FSDP run, or a full one into an FSDP run,
   goes through :mod:`looplm.train.sharded_checkpoint`, on any number of ranks;
6. write the ``start`` or ``resume`` record and call the callbacks' ``on_start``.

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
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from looplm.config_base import ConfigError
from looplm.errors import TrainingDiverged
from looplm.data import data_tokenizer, train_stream, validation_batches
from looplm.data.identity import data_identity, refuse_other_data
from looplm.model import LoopLM
from looplm.ops.backend import check_before_compile
from looplm.provenance import code_version, cpu_name
from looplm.tasks.config import is_task_source
from looplm.train import checkpointer
from looplm.train.activation_checkpointing import apply_activation_checkpointing
from looplm.train.callbacks import Callback, LossFn, default_objective, lm_loss
from looplm.train.checkpoint import config_differences, with_defaults
from looplm.train.distributed import Ranks
from looplm.train.growth import sgt_growth
from looplm.train.metrics import MetricsWriter, format_summary, json_safe, perplexity, recorded_data
from looplm.train.optim import build_optimizer
from looplm.train.params import parameter_counts
from looplm.train.schedule import lr_at
from looplm.train.task_eval import task_evaluation
from looplm.train.throughput import Throughput
from looplm.train.trackers import build_trackers
from looplm.train.validation import ValidationLoss

if TYPE_CHECKING:  # looplm.config imports looplm.train.config, so a runtime import here would be circular
    from looplm.config import RunConfig
    from looplm.model_config import ModelConfig

logger = logging.getLogger("looplm")


class Trainer:
    """Trains ``model_factory(run_cfg.model)`` (default :class:`LoopLM`) on ``run_cfg.data``
    as ``run_cfg.train`` says, minimising ``loss_fn`` (default :func:`lm_loss`).

    resume: ``False`` starts a fresh run and refuses an ``out_dir`` that already holds
    checkpoints; ``True`` continues from ``out_dir``'s latest checkpoint, or starts fresh
    (with a warning) when there is none, so a pre-emptible job can always pass it; a path
    (run, checkpoints or step directory) continues from that checkpoint, which must exist.
    progress: show a tqdm bar on stderr (rank 0 only).
    model_factory: builds the model to train from the model config, before a checkpoint is
    restored into it (distillation builds a student initialised from its teacher).
    loss_fn: the objective of one micro-batch (:data:`~looplm.train.callbacks.LossFn`).
    callbacks: :class:`~looplm.train.callbacks.Callback` objects called after the
    trainer's own (SGT growth, task evaluation, the validation loss); those with a
    ``state_key`` are saved in every checkpoint and restored on resume.

    Under ``torchrun`` initialise the process group before constructing the Trainer; rank
    0 writes checkpoints, metrics and the summary, and every rank reads checkpoints from
    ``out_dir`` (a shared file system).
    """

    def __init__(self, run_cfg: RunConfig, *, resume: Union[bool, str, os.PathLike] = False, progress: bool = True,
                 model_factory: Callable[[ModelConfig], nn.Module] = LoopLM, loss_fn: LossFn = lm_loss,
                 callbacks: Sequence[Callback] = ()):
        _check_parts(model_factory, loss_fn, callbacks)  # before any work
        self.cfg = run_cfg
        tc = run_cfg.train
        self.out_dir = Path(tc.out_dir)
        self.progress = progress
        self.ranks = Ranks.current()
        if self.ranks.is_main:
            _console_logging()
            _check_writable(self.out_dir)  # before any work: a run that cannot save would be lost
        self.device = _pick_device(tc.device, self.ranks.distributed)
        if tc.threads is not None:  # process-wide; resume-neutral: speed, not what is computed
            torch.set_num_threads(tc.threads)
        self.autocast_dtype = _autocast_dtype(tc.precision, self.device)
        _seed_everything(tc.seed)

        self.tokenizer = data_tokenizer(run_cfg.data)  # a task source brings its own vocabulary
        self.data_identity = data_identity(run_cfg.data, self.tokenizer)
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
        self.model = model_factory(run_cfg.model).to(self.device)
        # the default objective: at the count model.depth draws per step, with train.loss_rows
        self.loss_fn = default_objective(run_cfg.model, tc.seed, tc.loss_rows) if loss_fn is lm_loss else loss_fn
        # SGT (model.head_loop): entropy measured in training forwards (hooks placed before wrapping)
        self.growth = sgt_growth(self)
        source = checkpointer.resume_source(self.out_dir, resume)
        if source == self.out_dir:  # this run continued: on the data it trained on
            refuse_other_data(self.out_dir, run_cfg.data, recorded_data(self.out_dir / "metrics.jsonl"),
                              self.data_identity, "resume where the corpus and tokenizer are those it started "
                              "with, or start a new run in another train.out_dir")
        if tc.init_from is not None:
            if source is not None:
                raise ConfigError("train.init_from", tc.init_from,
                                  "null when resuming: the checkpoint already holds the weights")
            _load_initial_weights(self.model, tc.init_from, run_cfg.model, self.device)
        self.parallel = _parallel_mode(tc.parallel, self.ranks.distributed, run_cfg.data.source)
        self.train_model = self._wrap(self.model)  # FSDP shards in place: before the optimiser
        self.optimizer = build_optimizer(self.model, tc)
        rank, world_size = self.ranks.rank, self.ranks.world_size
        self.stream = train_stream(run_cfg.data, self.tokenizer, tc.batch_size, rank, world_size)
        # Task sources (data.source=task:NAME): task metrics at each evaluation, curriculum included.
        self.task_eval = task_evaluation(self)
        self.micro_batch = tc.batch_size // tc.grad_accum
        self.val_batches = validation_batches(run_cfg.data, self.tokenizer, self.micro_batch, rank, world_size)
        if not self.val_batches and self.task_eval is None and run_cfg.data.val_fraction > 0 and run_cfg.data.val_batches:
            logger.warning(
                "no validation set: the held-out split of %r (data.val_fraction=%g) has no window of data.seq_len + 1 "
                "= %d tokens, so val_loss will be missing; use more data, a shorter data.seq_len or a larger "
                "data.val_fraction", run_cfg.data.source, run_cfg.data.val_fraction, run_cfg.data.seq_len + 1,
            )
        self.tokens_per_step = tc.batch_size * run_cfg.data.seq_len * world_size
        self.callbacks: list[Callback] = [
            *(part for part in (self.growth, self.task_eval) if part is not None), ValidationLoss(), *callbacks]
        self.throughput = Throughput(self.model if self.growth is not None else run_cfg.model, run_cfg.data.seq_len,
                                     self.device, self.autocast_dtype or torch.float32, world_size)

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
            self.resumed_from = self.last_checkpoint = checkpointer.restore(self, source)
            self.last_saved_step = self.step

        metrics_path = self.out_dir / "metrics.jsonl"
        main = self.ranks.is_main
        if main and self.resumed_from is None and metrics_path.exists():
            logger.warning("%s has no checkpoint; its metrics.jsonl is replaced by this fresh run's", self.out_dir)
        trackers = build_trackers(tc.loggers, self.out_dir, wandb_project=tc.wandb_project, wandb_mode=tc.wandb_mode,
                                  config=run_cfg.to_dict()) if main else []
        self.metrics = MetricsWriter(metrics_path if main else None, fresh=self.resumed_from is None,
                                     trackers=trackers)
        if self.resumed_from is None:
            self.metrics.log("start", 0, parameters=parameter_counts(self.model), world_size=world_size,
                             device=str(self.device), code=code_version(), cpu=cpu_name(), data=self.data_identity)
        else:
            self.metrics.log("resume", self.step, checkpoint=str(self.resumed_from), world_size=world_size,
                             code=code_version(), cpu=cpu_name(), data=self.data_identity)
            logger.info("resumed from %s at step %d", self.resumed_from, self.step)
        for callback in self.callbacks:
            callback.on_start(self)

    # ------------------------------------------------------------------ setup
    def _wrap(self, model: nn.Module) -> nn.Module:
        tc = self.cfg.train
        apply_activation_checkpointing(model, tc.activation_checkpointing)
        wrapped: nn.Module = model
        if self.parallel == "fsdp":
            from looplm.train.fsdp import apply_fsdp

            apply_fsdp(model, fsdp_precision=tc.fsdp_precision, autocast_dtype=self.autocast_dtype,
                       world_size=self.ranks.world_size)
        elif self.parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DistributedDataParallel(model, device_ids=ids)
        mode = self.cfg.train.compile
        if mode:
            # a gated fla op checked on this device (Hopper with an affected Triton) gets its
            # verdict now, eagerly: the compiled step cannot run the check
            dtype = self.autocast_dtype or next(model.parameters()).dtype
            check_before_compile(model, self.device, dtype)
            wrapped = torch.compile(wrapped, **({} if mode is True else {"mode": mode}))
        return wrapped

    # ------------------------------------------------------------------ the loop
    def fit(self, stop_after: Optional[int] = None) -> dict[str, Any]:
        """Train to ``train.max_steps`` (or stop after step ``stop_after``, as a pre-empted
        job would: the schedule still runs to max_steps), evaluate, save a checkpoint,
        generate a sample, write ``summary.json`` and return the summary."""
        tc = self.cfg.train
        end = tc.max_steps if stop_after is None else min(stop_after, tc.max_steps)
        wall_start = time.perf_counter()
        bar = _progress_bar(total=tc.max_steps, initial=self.step, enabled=self.progress and self.ranks.is_main)
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
                    for callback in self.callbacks:  # outside the step's time (SGT growth's bookkeeping)
                        callback.on_step_end(self, self.step)
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
                    self.throughput.add(self.tokens_per_step, elapsed)
                    if read is None:
                        continue
                    loss, grad_norm, *aux = read
                    self.last_aux = dict(zip(names, aux))
                    if logged and math.isfinite(loss) and math.isfinite(grad_norm):
                        self._log_train(loss, lr, grad_norm, bar)
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
        sample = self.sample() if self.ranks.is_main or self.parallel == "fsdp" else None
        summary = self._summary(tokens_per_s=self.throughput.session_rate(),
                                wall_time_s=time.perf_counter() - wall_start, sample=sample)
        for callback in self.callbacks:
            callback.on_fit_end(self, summary)
        if self.ranks.is_main:
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

    def _log_train(self, loss: float, lr: float, grad_norm: float, bar) -> None:
        """The ``train`` record of a logged step: throughput and MFU over the steps since the last."""
        tps = self.throughput.window_rate()
        mfu = self.throughput.model_flops(tps)["mfu"]  # None where the peak is unknown (CPU)
        self.metrics.log("train", self.step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=self.tokens_seen,
                         tokens_per_s=tps, **({} if mfu is None else {"mfu": mfu}),
                         **{f"aux_{k}": v for k, v in self.last_aux.items()})
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", refresh=False)
        self.throughput.reset_window()

    def train_step(self) -> tuple[float, float]:
        """One optimiser step on the next batch at the schedule's learning rate, without
        :meth:`fit`'s bookkeeping (the step counter, logging, callbacks, evaluation and
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
                with self.autocast():
                    loss, aux = self.loss_fn(self.train_model, inputs[rows], targets[rows], self.step)
                (loss / tc.grad_accum).backward()
            loss_sum += loss.detach().float()
            for name, value in aux.items():
                aux_sum[name] = aux_sum.get(name, 0.0) + value.detach().float()
        # the loss and its auxiliary terms (ponder cost, Q-halt BCE, DSA indexer), averaged
        # over micro-batches and ranks in one reduction
        means = self.ranks.mean_(torch.stack([loss_sum, *aux_sum.values()]) / tc.grad_accum)
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

    def autocast(self) -> contextlib.AbstractContextManager:
        """The run's autocast (bf16) context, or none in fp32: forwards outside the step use it."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ evaluation, saving, sampling
    def evaluate(self) -> Optional[float]:
        """Run every callback's evaluation (task metrics, the validation loss, distillation's
        measures: ``on_eval``); returns the validation loss, None when the data has no
        validation split."""
        self.last_eval_step = self.step
        for callback in self.callbacks:
            callback.on_eval(self, self.step)
        return self.last_val_loss if self.val_batches else None

    def save(self) -> Path:
        """Write a checkpoint of the current step (:mod:`looplm.train.checkpointer`)."""
        path = checkpointer.save(self)
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
            return self.task_eval.sample(self)
        ids = self.tokenizer.encode(tc.sample_prompt) or [self.tokenizer.eos_id]
        new = min(tc.sample_tokens, self.cfg.model.max_seq_len - len(ids))
        if new <= 0:
            logger.warning("no sample: the prompt fills model.max_seq_len=%d", self.cfg.model.max_seq_len)
            return None
        generator = torch.Generator(device=self.device).manual_seed(tc.seed)
        self.model.eval()
        try:
            with self.autocast():
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
            **self.throughput.model_flops(tokens_per_s),
            "wall_time_s": wall_time_s,
            "train_time_s": self.train_time_s,
            "device": str(self.device),
            "precision": "fp32" if self.autocast_dtype is None else "bf16",
            "world_size": self.ranks.world_size,
            "checkpoint": None if self.last_checkpoint is None else str(self.last_checkpoint),
            "resumed_from": None if self.resumed_from is None else str(self.resumed_from),
            "sample": sample,
            "task": None,  # a task source's last task_eval record (n_max, ...), filled by its callback
            "config": cfg.to_dict(),
        }


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
    against its manifest) into ``model``; a different model config is refused, fields named,
    except the halting rule's weight-free fields (its objective: Ouro's Stage II starts from
    a Stage I run)."""
    from looplm.artifacts import MODEL_FILE, load_weights, read_weights_dir

    directory, config = read_weights_dir(path)
    saved = with_defaults(config["model"] if "model" in config else config, type(model_cfg), "model")
    free = tuple(f"model.halting.{field}:" for field in model_cfg.halting.WEIGHT_FREE_FIELDS)  # same weights
    differences = [d for d in config_differences(saved, model_cfg.to_dict(), "model") if not d.startswith(free)]
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


def _check_parts(model_factory: Any, loss_fn: Any, callbacks: Sequence[Any]) -> None:
    """Refuse a part the trainer cannot call, naming the argument, the value and what is allowed."""
    if not callable(model_factory):
        raise ConfigError("model_factory", model_factory, "a callable taking the model config and returning the model")
    if not callable(loss_fn):
        raise ConfigError("loss_fn", loss_fn, "a callable (model, inputs, targets, step) -> (loss, aux dict)")
    keys: set[str] = set()
    for i, callback in enumerate(callbacks):
        if not isinstance(callback, Callback):
            raise ConfigError(f"callbacks[{i}]", callback, "a looplm.train.Callback (subclass it, override its hooks)")
        key = callback.state_key
        if key is not None and (key in checkpointer.RESERVED_STATE_KEYS or key in keys):
            raise ConfigError(f"callbacks[{i}].state_key", key, "a key of trainer.pt not taken by the trainer "
                              f"({', '.join(sorted(checkpointer.RESERVED_STATE_KEYS))}) or another callback")
        if key is not None:
            keys.add(key)


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
