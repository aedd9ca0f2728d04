"""The ``distill`` config: LT2's distillation of a looped transformer into a hybrid (lt2.txt §5).

A STUDENT_CONFIG for ``looplm distill`` is a YAML mapping with up to three keys:
``distill`` (this section), ``data`` (the corpus of stages 1 and 2 and of the selector's
held-out batches; defaults to a looplm teacher run's own data) and ``train`` (the fields
every stage shares; ``train.out_dir`` is the distillation's root, each stage a run in
``OUT/stage1``, ``OUT/stage2``, ``OUT/stage3``). Each stage overrides ``max_steps`` and
``lr`` (and stage 3 its data and loss).

Choices where the paper leaves a number open (documented in docs/distillation.md):

* ``kd.top_k = 64``: the teacher's top-k tokens σ_top-k renormalises over;
* ``kd.temperature = 2.0`` with the KL multiplied by T_kd² (``kd.scale_t2``), Hinton et
  al.'s convention, so the gradient scale does not shrink with the temperature;
* w_t: ``kd.warmup_fraction = 0.1`` of stage 2 ramps linearly from final-loop-only to
  uniform weights, then ``kd.uniform_fraction = 0.5`` of the steps are uniform over the
  loops, then the final loop only (:func:`looplm.distill.losses.loop_weights`);
* progressive length: ``lengths`` (default data.seq_len / 4, / 2, / 1), equal shares of
  stage 2's steps (:func:`looplm.distill.losses.length_at`);
* stage 3 (the paper: the same KD loss at a constant learning rate on another corpus):
  ``stage3.loss = kd`` (final-loop supervision) or ``lm`` (plain next-token training),
  ``stage3.min_lr_ratio = 1`` (constant after warm-up).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from looplm.config_base import Config, ConfigError, check
from looplm.data.config import DataConfig
from looplm.mixers.config import MixerConfig
from looplm.mixers.gated_deltanet import GatedDeltaNetConfig
from looplm.mixers.linear import LinearMixerConfig
from looplm.train.config import TrainConfig

SELECTORS = ("kl", "uniform")
STAGES = ("1", "select", "2", "3", "all")


@dataclasses.dataclass(frozen=True)
class KDConfig(Config):
    """LT2's per-loop KD loss (Eq. kd-loss): KL(σ_top-k(z_T/T_kd) ‖ σ_top-k(z_S/T_kd)) per
    loop, weighted by w_t. ``schedule``: ``per_loop`` (warm-up, uniform, final: the paper's)
    or ``final`` (final-loop supervision throughout, the paper's comparison)."""

    top_k: int = 64
    temperature: float = 2.0
    scale_t2: bool = True
    schedule: Literal["per_loop", "final"] = "per_loop"
    warmup_fraction: float = 0.1
    uniform_fraction: float = 0.5

    def __post_init__(self) -> None:
        check(self.top_k >= 1, "distill.kd.top_k", self.top_k, "an integer >= 1")
        check(self.temperature > 0, "distill.kd.temperature", self.temperature, "a number > 0")
        check(self.schedule in ("per_loop", "final"), "distill.kd.schedule", self.schedule,
              "'per_loop' (warm-up, uniform over loops, then final loop) or 'final' (final loop only)")
        check(0 <= self.warmup_fraction < 1, "distill.kd.warmup_fraction", self.warmup_fraction, "a number in [0, 1)")
        check(0 <= self.uniform_fraction <= 1 - self.warmup_fraction, "distill.kd.uniform_fraction",
              self.uniform_fraction, f"a number in [0, 1 - warmup_fraction = {1 - self.warmup_fraction:g}]")


@dataclasses.dataclass(frozen=True)
class StageConfig(Config):
    """One stage's own training length and learning rate (the rest is the shared ``train``).
    ``min_lr_ratio`` null: train.min_lr_ratio. Stage 3 only: ``data`` (DataConfig fields
    that replace the shared data's; null: the same corpus) and ``loss``."""

    max_steps: int = 100
    lr: float = 1e-3
    min_lr_ratio: Optional[float] = None
    data: Optional[dict] = None
    loss: Literal["kd", "lm"] = "kd"

    def __post_init__(self) -> None:
        check(self.max_steps >= 0, "max_steps", self.max_steps, "an integer >= 0 (0 skips the stage)")
        check(self.lr > 0, "lr", self.lr, "a number > 0")
        check(self.min_lr_ratio is None or 0 <= self.min_lr_ratio <= 1, "min_lr_ratio",
              self.min_lr_ratio, "null or a number in [0, 1]")
        check(self.loss in ("kd", "lm"), "loss", self.loss,
              "'kd' (final-loop logit distillation) or 'lm' (next-token cross-entropy)")


@dataclasses.dataclass(frozen=True)
class DistillConfig(Config):
    """The pipeline: the student's linear ``mixer`` (any linear kind; GDN by default, with
    expand_v = 1 so its v projection has the teacher's shape); the kept-attention set F of
    ``round(keep_fraction · N)`` blocks (N distinct blocks) chosen by ``selector`` (``kl``:
    LT2's KL-guided selector on ``select_batches`` held-out batches; ``uniform``: evenly
    interleaved) or given as ``layers``; the stage-2 ``lengths``; the KD loss; the stages."""

    mixer: MixerConfig = GatedDeltaNetConfig(expand_v=1.0)
    keep_fraction: float = 0.25
    selector: Literal["kl", "uniform"] = "kl"
    layers: Optional[tuple[int, ...]] = None
    select_batches: int = 4
    lengths: Optional[tuple[int, ...]] = None
    kd: KDConfig = KDConfig()
    stage1: StageConfig = StageConfig(max_steps=100, lr=1e-3)
    stage2: StageConfig = StageConfig(max_steps=200, lr=3e-4)
    stage3: StageConfig = StageConfig(max_steps=0, lr=1e-4, min_lr_ratio=1.0)

    def __post_init__(self) -> None:
        if isinstance(self.mixer, dict):
            object.__setattr__(self, "mixer", MixerConfig.from_dict(self.mixer, prefix="distill.mixer"))
        check(isinstance(self.mixer, LinearMixerConfig), "distill.mixer.kind", self.mixer.kind,
              "a linear mixer kind: linear_attention, retnet, gla, hgrn2, mamba2, deltanet, gated_deltanet or kda")
        check(0 <= self.keep_fraction < 1, "distill.keep_fraction", self.keep_fraction,
              "a number in [0, 1): the share of blocks that keep softmax attention (LT2: 0.25)")
        check(self.selector in SELECTORS, "distill.selector", self.selector, f"one of {', '.join(SELECTORS)}")
        check(self.layers is None or all(i >= 0 for i in self.layers), "distill.layers", self.layers,
              "null or a list of block indices >= 0 (prelude, then core, then coda)")
        check(self.select_batches >= 1, "distill.select_batches", self.select_batches, "an integer >= 1")
        if self.lengths is not None:
            check(len(self.lengths) >= 1 and all(n >= 1 for n in self.lengths)
                  and list(self.lengths) == sorted(set(self.lengths)), "distill.lengths", list(self.lengths),
                  "null or an increasing list of sequence lengths >= 1")
        for name in ("stage1", "stage2", "stage3"):
            stage = getattr(self, name)
            check(name == "stage3" or stage.data is None, f"distill.{name}.data", stage.data,
                  "null: only stage 3 trains on another corpus")

    def stage_lengths(self, seq_len: int) -> tuple[int, ...]:
        """Stage 2's sequence lengths, each dividing ``seq_len`` (data.seq_len), the last equal to it."""
        if self.lengths is None:
            return tuple(seq_len // d for d in (4, 2, 1) if seq_len % d == 0 and seq_len // d >= 1) or (seq_len,)
        check(all(seq_len % n == 0 for n in self.lengths) and self.lengths[-1] == seq_len, "distill.lengths",
              list(self.lengths), f"lengths that divide data.seq_len={seq_len}, the last equal to it")
        return self.lengths

    def keep_count(self, n_blocks: int) -> int:
        """|F|: the explicit layers' count, else round(keep_fraction · N)."""
        if self.layers is not None:
            bad = [i for i in self.layers if i >= n_blocks]
            check(not bad, "distill.layers", list(self.layers), f"block indices below {n_blocks}, the teacher's blocks")
            return len(set(self.layers))
        return round(self.keep_fraction * n_blocks)


@dataclasses.dataclass(frozen=True)
class DistillRunConfig(Config):
    """A STUDENT_CONFIG: ``distill``, ``data`` and the shared ``train`` fields."""

    distill: DistillConfig = DistillConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig(out_dir="runs/distill")

    def __post_init__(self) -> None:
        self.distill.stage_lengths(self.data.seq_len)  # checked at load, not when stage 2 starts
        self.stage_data(3)

    @classmethod
    def from_dict(cls, data: Optional[dict[str, Any]], prefix: str = "") -> "DistillRunConfig":
        data = dict(data or {})
        unknown = sorted(set(data) - {"distill", "data", "train"})
        if unknown:
            raise ConfigError(unknown[0], data[unknown[0]],
                              "unknown top-level key of a distillation config; allowed keys: distill, data, train "
                              "(the student's model comes from the teacher)")
        return cls(
            distill=DistillConfig.from_dict(data.get("distill"), prefix="distill"),
            data=DataConfig.from_dict(data.get("data"), prefix="data"),
            train=TrainConfig.from_dict({"out_dir": "runs/distill", **(data.get("train") or {})}, prefix="train"),
        )

    def stage_train(self, stage: int) -> TrainConfig:
        """The shared train config with stage ``stage``'s steps, lr and output directory."""
        spec = getattr(self.distill, f"stage{stage}")
        fields = self.train.to_dict()
        fields.update(out_dir=f"{self.train.out_dir}/stage{stage}", max_steps=max(spec.max_steps, 1), lr=spec.lr)
        if spec.min_lr_ratio is not None:
            fields["min_lr_ratio"] = spec.min_lr_ratio
        if fields.get("warmup_steps") is not None and fields["warmup_steps"] >= fields["max_steps"]:
            fields["warmup_steps"] = 0
        return TrainConfig.from_dict(fields, prefix="train")

    def stage_data(self, stage: int) -> DataConfig:
        """The shared data, or for stage 3 its own ``distill.stage3.data`` fields over it."""
        spec = getattr(self.distill, f"stage{stage}")
        if spec.data is None:
            return self.data
        try:
            return DataConfig.from_dict({**self.data.to_dict(), **spec.data}, prefix="distill.stage3.data")
        except ConfigError as err:  # DataConfig's checks name data.*: say where this one sits
            field = err.field if not err.field.startswith("data.") else "distill.stage3." + err.field
            raise ConfigError(field, err.value, err.allowed) from None
