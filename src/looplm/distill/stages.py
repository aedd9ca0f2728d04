"""The distillation pipeline's stages as Trainer runs (lt2.txt §5).

Each stage is a :class:`~looplm.train.Trainer` run in its own directory under the root
``train.out_dir`` (``stage1``, ``stage2``, ``stage3``), so it checkpoints, resumes
exactly, logs ``metrics.jsonl`` and writes ``summary.json`` like ``looplm train``, and its
directory is an ordinary looplm run of the student (``looplm eval OUT/stage2``). A stage
is built on the Trainer's public seams (:func:`student_trainer`): a model factory (the
student, initialised from the teacher), a loss function (the stage's objective:
:class:`AlignmentLoss`, :class:`KDLoss`) and callbacks (its ``distill_eval`` records:
:class:`AlignmentEval`, :class:`KDEval`); the teacher is frozen and never saved.

* stage 1 (:func:`alignment_trainer`): F = ∅, the linear mixers alone learn
  (:mod:`looplm.distill.alignment`); ``val_loss`` is the all-linear student's, and
  ``distill_eval`` logs the held-out alignment MSE.
* selection: ``selection.json`` in the root (:mod:`looplm.distill.selection`).
* stage 2 (:func:`kd_trainer`): F restored, the whole student learns the per-loop KD
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
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from looplm.artifacts import write_text
from looplm.config import RunConfig
from looplm.config_base import ConfigError
from looplm.data import data_tokenizer, validation_batches
from looplm.distill.alignment import alignment_loss, record_teacher
from looplm.data.config import DataConfig
from looplm.distill.config import STAGES, DistillConfig, DistillRunConfig, KDConfig
from looplm.distill.losses import kd_loss, length_at, loop_weights, readout_loops, split_length, topk_kl
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
from looplm.model_config import ModelConfig
from looplm.train.callbacks import Callback, LossFn, lm_loss
from looplm.train.checkpoint import has_checkpoints
from looplm.train.trainer import Trainer

log = logging.getLogger("looplm")

SELECTION_FILE = "selection.json"


def _single_process(run_cfg: RunConfig) -> None:
    if dist.is_available() and dist.is_initialized():
        raise ConfigError("distill", "torchrun", "a single process: distillation does not run under torchrun yet")
    if run_cfg.train.compile:
        raise ConfigError("train.compile", True, "false: distillation calls the student outside one compiled forward")


def student_trainer(run_cfg: RunConfig, init: Callable[[LoopLM], Any], *, freeze: bool = False,
                    loss_fn: LossFn = lm_loss, callbacks: Sequence[Callback] = (),
                    resume: Union[bool, str] = False, progress: bool = True) -> Trainer:
    """A Trainer of the student ``LoopLM(run_cfg.model)`` passed through ``init(student)``
    (weights from the teacher or an earlier stage) before any checkpoint is restored;
    ``freeze``: only its linear mixers learn (stage 1)."""
    _single_process(run_cfg)

    def build_student(cfg: ModelConfig) -> LoopLM:
        model = LoopLM(cfg)
        init(model)
        if freeze:
            freeze_all_but_linear_mixers(model)
        return model

    return Trainer(run_cfg, model_factory=build_student, loss_fn=loss_fn, callbacks=callbacks, resume=resume,
                   progress=progress)


class TeacherOnDevice(Callback):
    """Moves the frozen teacher to the training device when the run starts."""

    def __init__(self, teacher: LoopLM):
        self.teacher = teacher

    def on_start(self, trainer: Trainer) -> None:
        self.teacher.to(trainer.device)


class AlignmentLoss:
    """Stage 1's objective: the alignment MSE of the student's linear mixers against the
    teacher's attention calls on the batch (:mod:`looplm.distill.alignment`)."""

    def __init__(self, teacher: LoopLM):
        self.teacher = teacher

    def __call__(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                 step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return alignment_loss(model, record_teacher(self.teacher, inputs)), {}


class AlignmentEval(TeacherOnDevice):
    """Logs ``distill_eval`` (``align_mse``, the held-out alignment MSE) at each evaluation,
    and at step 0 of a fresh run (where the alignment starts from)."""

    def on_start(self, trainer: Trainer) -> None:
        super().on_start(trainer)
        if trainer.resumed_from is None and trainer.val_batches:
            trainer.metrics.log("distill_eval", 0, align_mse=self.validation_mse(trainer))

    def on_eval(self, trainer: Trainer, step: int) -> None:
        if trainer.val_batches:
            trainer.metrics.log("distill_eval", step, align_mse=self.validation_mse(trainer))

    @torch.no_grad()
    def validation_mse(self, trainer: Trainer) -> float:
        """The alignment MSE on the held-out batches."""
        with trainer.autocast():
            return sum(alignment_loss(trainer.model, record_teacher(self.teacher, x.to(trainer.device))).item()
                       for x, _ in trainer.val_batches) / len(trainer.val_batches)


def alignment_trainer(run_cfg: RunConfig, teacher: LoopLM, init: Callable[[LoopLM], Any], *,
                      resume: Union[bool, str] = False, progress: bool = True) -> Trainer:
    """Stage 1: only the linear mixers train, on the alignment MSE."""
    return student_trainer(run_cfg, init, freeze=True, loss_fn=AlignmentLoss(teacher),
                           callbacks=[AlignmentEval(teacher)], resume=resume, progress=progress)


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


class KDLoss:
    """Stages 2 and 3: the student against the teacher's per-loop logits (Eq. kd-loss),
    at the progressive length of the step (``lengths`` over ``train.max_steps``), plus
    the student's own auxiliary losses; ``aux`` carries ``lm`` (the student's
    cross-entropy) and the step's ``seq_len``."""

    def __init__(self, teacher: LoopLM, kd: KDConfig, lengths: tuple[int, ...], run_cfg: RunConfig):
        self.teacher, self.kd, self.lengths = teacher, kd, lengths
        self.max_steps = run_cfg.train.max_steps

    def weights(self, model: LoopLM, step: int) -> list[float]:
        """The loop weights w_τ at ``step`` (one loop for a model without a topology)."""
        kd = self.kd
        return loop_weights(step, self.max_steps, readout_loops(model), kd.schedule, kd.warmup_fraction,
                            kd.uniform_fraction)

    def terms(self, model: LoopLM, inputs: torch.Tensor, targets: torch.Tensor,
              weights: list[float]) -> tuple[torch.Tensor, ModelOutput]:
        """(KD loss, the student's output) on one batch with loop weights ``weights``."""
        needed = [w > 0 for w in weights]
        with torch.no_grad():
            t_out = self.teacher(inputs, output_states=True)
            z_teacher = loop_logits(self.teacher, inputs, t_out, needed)
        s_out = model(inputs, targets, output_states=True)
        z_student = loop_logits(model, inputs, s_out, needed)
        pairs = [(t, s, w) for t, s, w in zip(z_teacher, z_student, weights) if w > 0]
        kd = self.kd
        loss = kd_loss(*zip(*pairs), top_k=kd.top_k, temperature=kd.temperature, scale_t2=kd.scale_t2, targets=targets)
        return loss, s_out

    def __call__(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                 step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        length = length_at(step, self.max_steps, self.lengths)
        inputs, targets = split_length(inputs, length), split_length(targets, length)
        loss, out = self.terms(model, inputs, targets, self.weights(model, step))
        aux = dict(out.aux_losses)
        halting = model.halting
        # the student's own auxiliary losses (DSA's indexer, ACT's ponder cost), not a halting
        # rule's task loss (the exit gate's expected objective): KD replaces that
        if aux and (halting is None or halting.trains_readout):
            loss = loss + sum(aux.values())
        aux.update(lm=out.lm_loss.detach(), seq_len=torch.tensor(float(length), device=loss.device))
        return loss, aux


class KDEval(TeacherOnDevice):
    """Logs ``distill_eval`` (``kd_final``: the top-k KL of the final logits on the
    held-out batches) at each evaluation."""

    def __init__(self, teacher: LoopLM, kd: KDConfig):
        super().__init__(teacher)
        self.kd = kd

    @torch.no_grad()
    def on_eval(self, trainer: Trainer, step: int) -> None:
        if not trainer.val_batches:
            return
        kd, total = self.kd, 0.0
        with trainer.autocast():
            for x, y in trainer.val_batches:
                x, y = x.to(trainer.device), y.to(trainer.device)
                total += topk_kl(self.teacher(x).logits, trainer.model(x).logits, kd.top_k, kd.temperature, y).item()
        trainer.metrics.log("distill_eval", step, kd_final=total / len(trainer.val_batches))


def kd_trainer(run_cfg: RunConfig, teacher: LoopLM, init: Callable[[LoopLM], Any], *, kd: KDConfig,
               lengths: tuple[int, ...], resume: Union[bool, str] = False, progress: bool = True) -> Trainer:
    """Stages 2 and 3 with the KD loss: the whole student learns."""
    return student_trainer(run_cfg, init, loss_fn=KDLoss(teacher, kd, lengths, run_cfg),
                           callbacks=[KDEval(teacher, kd)], resume=resume, progress=progress)


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
    cfg.distill.keep_count(len(block_paths(teacher.cfg)))  # distill.layers checked before any stage trains
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
            results[name] = _select(teacher, cfg, root).to_dict()
        elif name == "2":
            results[name] = _stage2(teacher, cfg, root, resume, progress)
        else:
            results[name] = _stage3(teacher, cfg, root, resume, progress)
    return results


def _stage1(teacher: LoopLM, cfg: DistillRunConfig, resume: bool, progress: bool) -> dict[str, Any]:
    run_cfg = RunConfig(model=student_config(teacher.cfg, cfg.distill.mixer, []), data=cfg.data, train=cfg.stage_train(1))
    trainer = alignment_trainer(run_cfg, teacher, lambda s: init_student(s, teacher),
                                resume=_resume_arg(Path(run_cfg.train.out_dir), resume), progress=progress)
    return trainer.fit()


def choose_layers(teacher: LoopLM, distill: DistillConfig, data: DataConfig, batch_size: int, device: str,
                  stage1_dir: Path) -> Selection:
    """The kept-attention set F of ``distill`` (lt2.txt §5, Stage 2): ``distill.layers`` as
    given, the uniform interleave, or the KL-guided selector on the stage-1 student in
    ``stage1_dir`` scored on ``distill.select_batches`` held-out batches of ``data``
    (micro-batches of ``batch_size``) on ``device`` (``train.device``)."""
    n_blocks = len(block_paths(teacher.cfg))
    keep = distill.keep_count(n_blocks)
    if distill.layers is not None:
        return Selection("layers", sorted(set(distill.layers)))
    if distill.selector == "uniform" or keep == 0:
        return Selection("uniform", uniform_layers(n_blocks, keep))
    torch_device = _device(device)
    aligned = _final_student(stage1_dir, "1").to(torch_device)
    batches = [x.to(torch_device) for x, _ in validation_batches(data, data_tokenizer(data), batch_size)]
    if not batches:
        raise ConfigError("data.val_fraction", data.val_fraction,
                          "a held-out split with at least one batch: the KL-guided selector scores on it")
    return kl_guided(teacher.to(torch_device), aligned, keep, batches[: distill.select_batches])


def write_selection(selection: Selection, path: Path) -> None:
    """``selection.json``, and every score in the log."""
    write_text(path, json.dumps(selection.to_dict(), indent=2) + "\n", atomic=True)
    log.info("distill: kept softmax attention in blocks %s (%s selector)%s", selection.layers, selection.selector,
             "".join(f"\n  block {i}: KL {selection.kl[i]:.4f}, score {s:+.4f}" for i, s in selection.scores.items()))


def _select(teacher: LoopLM, cfg: DistillRunConfig, root: Path) -> Selection:
    selection = choose_layers(teacher, cfg.distill, cfg.data, cfg.train.batch_size // cfg.train.grad_accum,
                              cfg.train.device, root / "stage1")
    write_selection(selection, root / SELECTION_FILE)
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
    trainer = kd_trainer(run_cfg, teacher, lambda s: init_student(s, teacher, linear_from=aligned), kd=cfg.distill.kd,
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
        return student_trainer(run_cfg, init, resume=resume_arg, progress=progress).fit()
    kd = KDConfig(**{**cfg.distill.kd.to_dict(), "schedule": "final"})
    return kd_trainer(run_cfg, teacher, init, kd=kd, lengths=(data.seq_len,), resume=resume_arg,
                      progress=progress).fit()
