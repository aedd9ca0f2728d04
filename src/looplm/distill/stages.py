"""The distillation pipeline's stages as Trainer runs (lt2.txt §5).

Each stage is a :class:`~looplm.train.Trainer` run in its own directory under the root
``train.out_dir`` (``stage1``, ``stage2``, ``stage3``), so it checkpoints, resumes
exactly, logs ``metrics.jsonl`` and writes ``summary.json`` like ``looplm train``, and its
directory is an ordinary looplm run of the student (``looplm eval OUT/stage2``). The
subclasses change two hooks: ``_build_model`` (the student, initialised from the teacher)
and ``_forward_loss`` (the stage's objective); the teacher is frozen and never saved.

* stage 1 (:class:`AlignmentTrainer`): F = ∅, the linear mixers alone learn
  (:mod:`looplm.distill.alignment`); ``val_loss`` is the all-linear student's, and
  ``distill_eval`` logs the held-out alignment MSE.
* selection: ``selection.json`` in the root (:mod:`looplm.distill.selection`).
* stage 2 (:class:`KDTrainer`): F restored, the whole student learns the per-loop KD
  loss with progressive length (:mod:`looplm.distill.losses`); its train records carry
  ``aux_lm`` (the student's cross-entropy) and the step's ``aux_seq_len``.
* stage 3: continued training on ``distill.stage3.data``: the KD loss with final-loop
  supervision (the paper's) or plain cross-entropy (``distill.stage3.loss=lm``).

Distillation runs in one process (``torchrun`` and ``train.compile`` are refused): stage 1
calls the student's mixers outside its forward, where DDP would not see them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from looplm.artifacts import write_text
from looplm.config import RunConfig
from looplm.config_base import ConfigError
from looplm.data import data_tokenizer, validation_batches
from looplm.distill.alignment import alignment_loss, record_teacher
from looplm.distill.config import STAGES, DistillRunConfig, KDConfig
from looplm.distill.losses import kd_loss, length_at, loop_weights, split_length, topk_kl
from looplm.distill.selection import Selection, kl_guided, uniform_layers
from looplm.distill.student import (
    block_paths,
    freeze_all_but_linear_mixers,
    init_student,
    load_teacher,
    student_config,
)
from looplm.errors import LoopLMError
from looplm.model import LoopLM, ModelOutput
from looplm.train.checkpoint import has_checkpoints
from looplm.train.trainer import Trainer

log = logging.getLogger("looplm")

SELECTION_FILE = "selection.json"


class DistillTrainer(Trainer):
    """A Trainer whose model is a student: ``LoopLM(run_cfg.model)`` passed through
    ``init(student)`` (weights from the teacher or an earlier stage) before any checkpoint
    is restored; ``teacher`` (frozen) is moved to the training device."""

    def __init__(self, run_cfg: RunConfig, teacher: Optional[LoopLM], init: Callable[[LoopLM], Any], *,
                 resume: Union[bool, str] = False, progress: bool = True):
        if dist.is_available() and dist.is_initialized():
            raise ConfigError("distill", "torchrun", "a single process: distillation does not run under torchrun yet")
        if run_cfg.train.compile:
            raise ConfigError("train.compile", True, "false: distillation calls the student outside one compiled forward")
        self.teacher, self._init = teacher, init
        super().__init__(run_cfg, resume=resume, progress=progress)

    def _build_model(self) -> LoopLM:
        if self.teacher is not None:
            self.teacher.to(self.device)
        model = LoopLM(self.cfg.model)
        self._init(model)
        return model


class AlignmentTrainer(DistillTrainer):
    """Stage 1: only the linear mixers train, on the alignment MSE."""

    def _build_model(self) -> LoopLM:
        model = super()._build_model()
        freeze_all_but_linear_mixers(model)
        return model

    def _forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return alignment_loss(self.model, record_teacher(self.teacher, inputs)), {}

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.resumed_from is None and self.val_batches:  # where the alignment starts from
            self.metrics.log("distill_eval", 0, align_mse=self.validation_mse())

    @torch.no_grad()
    def validation_mse(self) -> float:
        """The alignment MSE on the held-out batches."""
        with self._autocast():
            return sum(alignment_loss(self.model, record_teacher(self.teacher, x.to(self.device))).item()
                       for x, _ in self.val_batches) / len(self.val_batches)

    def evaluate(self) -> Optional[float]:
        val_loss = super().evaluate()
        if self.val_batches:
            self.metrics.log("distill_eval", self.step, align_mse=self.validation_mse())
        return val_loss


def loop_logits(model: LoopLM, ids: torch.Tensor, out: ModelOutput, needed: list[bool]) -> list[Optional[torch.Tensor]]:
    """z^(τ) for τ = 1..T where ``needed`` (None elsewhere): the readout of each loop state;
    a model without a loop has one, its logits."""
    if out.states is None:
        return [out.logits]
    states = out.states[1:]
    # a halting rule that froze every position stops the loop early: the later states equal the last
    states = states + [states[-1]] * (len(needed) - len(states))
    chosen = [h for h, need in zip(states, needed) if need]
    read = iter(model.loop_logits(ids, chosen)) if chosen else iter(())
    return [next(read) if need else None for need in needed]


class KDTrainer(DistillTrainer):
    """Stages 2 and 3: the student against the teacher's per-loop logits (Eq. kd-loss)."""

    def __init__(self, run_cfg: RunConfig, teacher: LoopLM, init: Callable[[LoopLM], Any], *, kd: KDConfig,
                 lengths: tuple[int, ...], resume: Union[bool, str] = False, progress: bool = True):
        self.kd, self.lengths = kd, lengths
        super().__init__(run_cfg, teacher, init, resume=resume, progress=progress)

    def weights(self, step: int) -> list[float]:
        loops = self.cfg.model.iterations if self.model.topology is not None else 1
        kd, total = self.kd, self.cfg.train.max_steps
        return loop_weights(step, total, loops, kd.schedule, kd.warmup_fraction, kd.uniform_fraction)

    def kd_terms(self, inputs: torch.Tensor, targets: torch.Tensor, weights: list[float]):
        """(KD loss, the student's output) on one batch with loop weights ``weights``."""
        needed = [w > 0 for w in weights]
        with torch.no_grad():
            t_out = self.teacher(inputs, output_states=True)
            z_teacher = loop_logits(self.teacher, inputs, t_out, needed)
        s_out = self.model(inputs, targets, output_states=True)
        z_student = loop_logits(self.model, inputs, s_out, needed)
        pairs = [(t, s, w) for t, s, w in zip(z_teacher, z_student, weights) if w > 0]
        kd = self.kd
        loss = kd_loss(*zip(*pairs), top_k=kd.top_k, temperature=kd.temperature, scale_t2=kd.scale_t2, targets=targets)
        return loss, s_out

    def _forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        length = length_at(self.step, self.cfg.train.max_steps, self.lengths)
        inputs, targets = split_length(inputs, length), split_length(targets, length)
        loss, out = self.kd_terms(inputs, targets, self.weights(self.step))
        aux = dict(out.aux_losses)
        halting = self.model.halting
        # the student's own auxiliary losses (DSA's indexer, ACT's ponder cost), not a halting
        # rule's task loss (the exit gate's expected objective): KD replaces that
        if aux and (halting is None or halting.trains_readout):
            loss = loss + sum(aux.values())
        aux.update(lm=out.lm_loss.detach(), seq_len=torch.tensor(float(length), device=loss.device))
        return loss, aux

    def evaluate(self) -> Optional[float]:
        val_loss = super().evaluate()
        if self.val_batches:
            kd, total = self.kd, 0.0
            with torch.no_grad(), self._autocast():
                for x, y in self.val_batches:
                    x, y = x.to(self.device), y.to(self.device)
                    total += topk_kl(self.teacher(x).logits, self.model(x).logits, kd.top_k, kd.temperature, y).item()
            self.metrics.log("distill_eval", self.step, kd_final=total / len(self.val_batches))
        return val_loss


# ---------------------------------------------------------------------- the pipeline
def load_distill_config(teacher: Union[str, Path], source: Optional[str] = None,
                        overrides: tuple[str, ...] = ()) -> DistillRunConfig:
    """A STUDENT_CONFIG (YAML path, or None for the defaults) with ``key=value``
    overrides; ``data`` starts from a looplm teacher run's own data config."""
    from looplm.artifacts import read_weights_dir
    from looplm.config import parse_overrides, read_config_source
    from looplm.config_base import set_dotted

    raw = read_config_source(source) if source is not None else {}
    for key, value in parse_overrides(overrides):
        set_dotted(raw, key, value)
    config = Path(teacher) / "config.json"
    is_hf = config.is_file() and "model_type" in json.loads(config.read_text(encoding="utf-8"))
    if not is_hf:
        _, saved = read_weights_dir(teacher, verify=False)
        if isinstance(saved.get("data"), dict):
            raw["data"] = {**saved["data"], **(raw.get("data") or {})}
    return DistillRunConfig.from_dict(raw)


def _finished(out_dir: Path) -> bool:
    summary = out_dir / "summary.json"
    if not summary.is_file():
        return False
    data = json.loads(summary.read_text(encoding="utf-8"))
    return data.get("steps") == data.get("max_steps")


def _resume_arg(out_dir: Path, resume: bool) -> Union[bool, str]:
    return True if resume and has_checkpoints(out_dir) else False


def _final_student(out_dir: Path, stage: str) -> LoopLM:
    if not has_checkpoints(out_dir):
        raise LoopLMError(f"{out_dir} holds no checkpoint: run `looplm distill ... --stage {stage}` first")
    return LoopLM.from_pretrained(out_dir)


def run_distill(teacher_path: Union[str, Path], cfg: DistillRunConfig, stage: str = "all", *,
                resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run ``stage`` (1, select, 2, 3 or all) of the distillation of ``teacher_path``;
    returns each stage's summary (or the selection). ``resume``: continue a stage from its
    latest checkpoint, and under ``all`` skip the stages that finished."""
    if stage not in STAGES:
        raise ConfigError("--stage", stage, f"one of {', '.join(STAGES)}")
    root = Path(cfg.train.out_dir)
    root.mkdir(parents=True, exist_ok=True)
    teacher = load_teacher(teacher_path)
    write_text(root / "distill.json", json.dumps({"teacher": str(teacher_path), "config": cfg.to_dict()}, indent=2)
               + "\n", atomic=True)
    n_blocks = len(block_paths(teacher.cfg))
    keep = cfg.distill.keep_count(n_blocks)
    results: dict[str, Any] = {}
    for name in (("1", "select", "2", "3") if stage == "all" else (stage,)):
        out_dir = root / (f"stage{name}" if name != "select" else "")
        if name in ("1", "2", "3") and getattr(cfg.distill, f"stage{name}").max_steps == 0:
            log.info("distill: stage %s skipped (distill.stage%s.max_steps=0)", name, name)
            continue
        if stage == "all" and resume and name != "select" and _finished(out_dir):
            log.info("distill: stage %s already finished in %s", name, out_dir)
            continue
        if name == "select" and stage == "all" and resume and (root / SELECTION_FILE).is_file():
            continue
        log.info("distill: stage %s", name)
        if name == "1":
            results[name] = _stage1(teacher, cfg, resume, progress)
        elif name == "select":
            results[name] = _select(teacher, cfg, keep, root).to_dict()
        elif name == "2":
            results[name] = _stage2(teacher, cfg, root, resume, progress)
        else:
            results[name] = _stage3(teacher, cfg, root, resume, progress)
    return results


def _stage1(teacher: LoopLM, cfg: DistillRunConfig, resume: bool, progress: bool) -> dict[str, Any]:
    run_cfg = RunConfig(model=student_config(teacher.cfg, cfg.distill.mixer, []), data=cfg.data, train=cfg.stage_train(1))
    trainer = AlignmentTrainer(run_cfg, teacher, lambda s: init_student(s, teacher),
                               resume=_resume_arg(Path(run_cfg.train.out_dir), resume), progress=progress)
    return trainer.fit()


def _select(teacher: LoopLM, cfg: DistillRunConfig, keep: int, root: Path) -> Selection:
    d = cfg.distill
    n_blocks = len(block_paths(teacher.cfg))
    if d.layers is not None:
        selection = Selection("layers", sorted(set(d.layers)))
    elif d.selector == "uniform" or keep == 0:
        selection = Selection("uniform", uniform_layers(n_blocks, keep))
    else:
        device = _device(cfg.train.device)
        aligned = _final_student(root / "stage1", "1").to(device)
        tokenizer = data_tokenizer(cfg.data)
        micro = cfg.train.batch_size // cfg.train.grad_accum
        batches = [x.to(device) for x, _ in validation_batches(cfg.data, tokenizer, micro)[: d.select_batches]]
        if not batches:
            raise ConfigError("data.val_fraction", cfg.data.val_fraction,
                              "a held-out split with at least one batch: the KL-guided selector scores on it")
        selection = kl_guided(teacher.to(device), aligned, keep, batches)
    write_text(root / SELECTION_FILE, json.dumps(selection.to_dict(), indent=2) + "\n", atomic=True)
    log.info("distill: kept softmax attention in blocks %s (%s selector)%s", selection.layers, selection.selector,
             "".join(f"\n  block {i}: KL {selection.kl[i]:.4f}, score {s:+.4f}" for i, s in selection.scores.items()))
    return selection


def _device(spec: str) -> torch.device:
    """The selector's device: ``train.device``, ``auto`` being CUDA when available."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if spec == "auto" else spec)


def _read_selection(root: Path) -> Selection:
    path = root / SELECTION_FILE
    if not path.is_file():
        raise LoopLMError(f"{path} not found: run `looplm distill ... --stage select` before stage 2")
    return Selection.from_dict(json.loads(path.read_text(encoding="utf-8")))


def _stage2(teacher: LoopLM, cfg: DistillRunConfig, root: Path, resume: bool, progress: bool) -> dict[str, Any]:
    selection = _read_selection(root)
    aligned = LoopLM.from_pretrained(root / "stage1") if has_checkpoints(root / "stage1") else None
    if aligned is None:
        log.warning("distill: no stage-1 student in %s; the linear mixers start from the attention projections",
                    root / "stage1")
    run_cfg = RunConfig(model=student_config(teacher.cfg, cfg.distill.mixer, selection.layers), data=cfg.data,
                        train=cfg.stage_train(2))
    trainer = KDTrainer(run_cfg, teacher, lambda s: init_student(s, teacher, linear_from=aligned), kd=cfg.distill.kd,
                        lengths=cfg.distill.stage_lengths(cfg.data.seq_len),
                        resume=_resume_arg(Path(run_cfg.train.out_dir), resume), progress=progress)
    return trainer.fit()


def _stage3(teacher: LoopLM, cfg: DistillRunConfig, root: Path, resume: bool, progress: bool) -> dict[str, Any]:
    previous = _final_student(root / "stage2", "2")
    data = cfg.stage_data(3)
    run_cfg = RunConfig(model=previous.cfg, data=data, train=cfg.stage_train(3))

    def init(student: LoopLM) -> None:
        student.load_state_dict(previous.state_dict())

    resume_arg = _resume_arg(Path(run_cfg.train.out_dir), resume)
    if cfg.distill.stage3.loss == "lm":
        return DistillTrainer(run_cfg, None, init, resume=resume_arg, progress=progress).fit()
    kd = KDConfig(**{**cfg.distill.kd.to_dict(), "schedule": "final"})
    return KDTrainer(run_cfg, teacher, init, kd=kd, lengths=(data.seq_len,), resume=resume_arg,
                     progress=progress).fit()
