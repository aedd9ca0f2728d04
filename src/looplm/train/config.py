"""Configuration of a training run: optimisation, schedule, precision, logging, checkpoints."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional, Union

from looplm.config_base import Config, check


@dataclasses.dataclass(frozen=True)
class TrainConfig(Config):
    """AdamW with linear warmup and cosine decay to ``min_lr_ratio`` · lr (the papers use
    1% warmup and a 10% floor). ``batch_size`` is sequences per optimiser step per
    data-parallel rank, split into ``grad_accum`` micro-batches. ``activation_checkpointing``
    (none, block, iteration) recomputes activations in the backward instead of keeping them
    (:mod:`looplm.train.activation_checkpointing`); it does not change what is computed. ``parallel``
    picks the data-parallel wrapper under torchrun: ``auto`` (DDP when the world size is
    above 1), ``ddp`` (full replicas) or ``fsdp`` (FSDP2, parameters, gradients and
    optimiser state sharded across ranks, :mod:`looplm.train.fsdp`); ``fsdp_precision`` is
    FSDP2's mixed-precision policy: ``bf16`` (bf16 parameters for compute and all-gathers,
    fp32 gradient reduction), ``fp32``, or ``auto`` (bf16 when ``precision`` resolves to
    bf16 autocast, else fp32). Sharded weights and optimiser state stay fp32 either way."""

    out_dir: str = "runs/default"
    max_steps: int = 1000
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.01
    warmup_steps: Optional[int] = None
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_norms_and_biases: bool = False
    grad_clip: float = 1.0
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # torch.compile the model: true (inductor's default mode) or a mode; reduce-overhead
    # replays each micro-step's forward and backward as CUDA graphs (static shapes)
    compile: Union[bool, Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]] = False
    activation_checkpointing: Literal["none", "block", "iteration"] = "none"
    # > 0: the default objective and the validation loss compute the cross-entropy without
    # the [tokens, vocab] logits, this many rows at a time (LoopLM.forward's loss_rows); 0
    # from the logits
    loss_rows: int = 0
    parallel: Literal["auto", "ddp", "fsdp"] = "auto"
    fsdp_precision: Literal["auto", "bf16", "fp32"] = "auto"
    device: str = "auto"
    # Intra-op CPU threads (torch.set_num_threads, process-wide) when set; null leaves torch's default.
    threads: Optional[int] = None
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    save_every: int = 500
    keep_last: Optional[int] = None
    max_bad_steps: int = 5
    sample_prompt: str = "The "
    sample_tokens: int = 200
    sample_temperature: float = 0.8
    loggers: tuple[str, ...] = ("jsonl",)
    wandb_project: str = "looplm"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    # Start from these weights (a save_pretrained directory, e.g. from `looplm convert`, or a
    # checkpoint) instead of the random init; the model config must match. Not with resume.
    init_from: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("lr", "min_lr_ratio", "warmup_fraction", "beta1", "beta2", "eps", "weight_decay", "grad_clip",
                     "sample_temperature"):  # from Python too, not only through from_dict
            check(math.isfinite(getattr(self, name)), f"train.{name}", getattr(self, name), "a finite number")
        positive = "an integer >= 1"
        check(self.max_steps >= 1, "train.max_steps", self.max_steps, positive)
        check(self.batch_size >= 1, "train.batch_size", self.batch_size, positive)
        check(self.grad_accum >= 1, "train.grad_accum", self.grad_accum, positive)
        check(
            self.batch_size % self.grad_accum == 0,
            "train.grad_accum",
            self.grad_accum,
            f"a divisor of train.batch_size={self.batch_size}",
        )
        check(self.lr > 0, "train.lr", self.lr, "a number > 0")
        check(self.loss_rows >= 0, "train.loss_rows", self.loss_rows, "0 (the loss from the logits) or a number of rows >= 1")
        check(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        check(0.0 <= self.warmup_fraction < 1.0, "train.warmup_fraction", self.warmup_fraction, "a number in [0, 1)")
        check(
            self.warmup_steps is None or 0 <= self.warmup_steps < self.max_steps,
            "train.warmup_steps",
            self.warmup_steps,
            f"null or an integer in [0, max_steps={self.max_steps})",
        )
        check(0.0 <= self.beta1 < 1.0, "train.beta1", self.beta1, "a number in [0, 1)")
        check(0.0 <= self.beta2 < 1.0, "train.beta2", self.beta2, "a number in [0, 1)")
        check(self.eps > 0, "train.eps", self.eps, "a number > 0")
        check(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "a number >= 0")
        check(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "a number >= 0 (0 disables clipping)")
        check(self.log_every >= 1, "train.log_every", self.log_every, positive)
        check(self.eval_every >= 0, "train.eval_every", self.eval_every, "an integer >= 0 (0 disables)")
        check(self.save_every >= 0, "train.save_every", self.save_every, "an integer >= 0 (0: only at the end)")
        check(
            self.keep_last is None or self.keep_last >= 1,
            "train.keep_last",
            self.keep_last,
            "null (keep every checkpoint) or an integer >= 1",
        )
        check(self.threads is None or self.threads >= 1, "train.threads", self.threads,
              "null (torch's default) or an integer >= 1")
        check(self.max_bad_steps >= 1, "train.max_bad_steps", self.max_bad_steps, positive)
        check(self.sample_tokens >= 0, "train.sample_tokens", self.sample_tokens, "an integer >= 0")
        check(self.sample_temperature >= 0, "train.sample_temperature", self.sample_temperature, "a number >= 0")
        check(self.activation_checkpointing in ("none", "block", "iteration"), "train.activation_checkpointing",
              self.activation_checkpointing, "none, block (recompute each block) or iteration (recompute each "
              "loop iteration)")
        check(not (self.compile and self.activation_checkpointing != "none"), "train.activation_checkpointing",
              self.activation_checkpointing, "none while train.compile=true: recomputation under torch.compile "
              "is not supported yet (set train.compile=false to checkpoint activations)")
        check(self.parallel in ("auto", "ddp", "fsdp"), "train.parallel", self.parallel,
              "auto (ddp when launched on several processes), ddp or fsdp")
        check(self.fsdp_precision in ("auto", "bf16", "fp32"), "train.fsdp_precision", self.fsdp_precision,
              "auto, bf16 (bf16 compute, fp32 gradient reduction) or fp32")
        check(self.fsdp_precision == "auto" or self.parallel == "fsdp", "train.fsdp_precision",
              self.fsdp_precision, f"auto unless train.parallel=fsdp (it is {self.parallel}): the policy only "
              "applies to FSDP2; set train.parallel=fsdp or drop train.fsdp_precision")
        check(not (self.compile and self.parallel == "fsdp"), "train.compile", self.compile,
              "false with train.parallel=fsdp: compiling the FSDP2-sharded model is not supported yet (set "
              "train.compile=false, or train.parallel=ddp to compile)")
        from looplm.train.trackers import LOGGERS

        check(all(name in LOGGERS for name in self.loggers) and len(set(self.loggers)) == len(self.loggers),
              "train.loggers", list(self.loggers), f"a list of distinct entries from {', '.join(LOGGERS)} "
              "(metrics.jsonl is always written)")

    @property
    def warmup(self) -> int:
        """Warmup steps: ``warmup_steps`` if set, else ``warmup_fraction`` of max_steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return int(self.warmup_fraction * self.max_steps)
