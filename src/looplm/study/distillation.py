"""The ``distill`` study's runs (issue 28): LT2's distillation recipe (lt2.txt §5) inside the
study runner, so that whether distillation saves tokens is decided by paired seeds.

Per seed s, in training order (each an ordinary looplm run in ``OUT/RUN/seed-s``):

- ``teacher``: the looped transformer, trained here for the teacher's steps;
- ``stage1``: stage 1 (F = ∅, the linear mixers aligned to the teacher's attention outputs,
  :func:`looplm.distill.stages.alignment_trainer`); the seed's KL-guided selection of F is
  then written beside it (``stage1/seed-s/selection.json``);
- ``scratch-teacher-budget``: the hybrid (that F) trained from scratch for the teacher's
  steps; its validation curve says how many tokens training from scratch needs to reach
  each later row's loss (the ``match_tokens`` / ``saved_tokens`` columns);
- ``scratch``: the hybrid from scratch at the student's budget (stage 1 + stage 2 steps):
  the reference, the control distillation must beat to save tokens;
- ``distill-per-loop`` / ``distill-final``: stage 2 from the stage-1 student and selection
  (:func:`looplm.distill.stages.kd_trainer`), with LT2's per-loop w_t schedule (Eq.
  kd-loss) or the final loop only; ``distill.json`` in the run records the teacher, the
  stage-1 run, F and the KD settings.

The runs' configs come from the size's RunSpecs (the teacher's model, each row's steps and
rate); :func:`build` swaps in the student's model (``student_config``) for every row but
the teacher. F depends on the seed's stage-1 run: until its ``selection.json`` exists the
configs carry the uniform interleave, and :func:`prepare` returns the config with the
selected F before a hybrid row trains (so a rerun, which reads the file, sees the configs
the runs trained with). :func:`trainer` is the study's ``trainer`` hook: stage 1 and 2 are
Trainer runs with the distillation's loss and callbacks, so they checkpoint, resume
exactly and are skipped when finished like every study run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from looplm.accounting import count_flops
from looplm.accounting.flops import build_meta_model
from looplm.artifacts import write_text
from looplm.config import RunConfig
from looplm.distill.config import DistillConfig
from looplm.distill.flops import alignment_flops, kd_flops
from looplm.distill.selection import Selection, uniform_layers
from looplm.distill.stages import SELECTION_FILE, alignment_trainer, choose_layers, kd_trainer, write_selection
from looplm.distill.student import block_paths, init_student, load_teacher, student_config
from looplm.errors import LoopLMError
from looplm.model import LoopLM
from looplm.model_config import ModelConfig
from looplm.study.definition import Measures, RunSpec, Study, preset_configs, run_dir
from looplm.study.runs import Run, events_by_step, validation
from looplm.train.checkpoint import has_checkpoints
from looplm.train.trainer import Trainer

logger = logging.getLogger("looplm")

TEACHER, LONG, SCRATCH, STAGE1 = "teacher", "scratch-teacher-budget", "scratch", "stage1"
#: distilled rows -> their stage-2 loop-weight schedule (``distill.kd.schedule``)
DISTILLED = {"distill-per-loop": "per_loop", "distill-final": "final"}
#: the rows trained after the from-scratch hybrid at the teacher's budget: their loss is looked up on its curve
MATCHED = (SCRATCH, *DISTILLED)
#: LT2 §5: GDN (expand_v = 1, so W_v and W_O transfer), 25 % of the blocks keep softmax
#: attention, chosen by the KL-guided selector; KD with top-k 64 at T_kd = 2 (docs/distillation.md)
SETTINGS = DistillConfig(keep_fraction=0.25, selector="kl", select_batches=4)
#: the settings a distilled run's ``distill.json`` records (its steps and rate are its config's)
RECORDED = ("mixer", "keep_fraction", "selector", "select_batches", "kd")


def runs(preset: str, model: Sequence[str], teacher_steps: int, stage1_steps: int, stage2_steps: int, *, lr: float,
         stage1_lr: float, stage2_lr: float) -> dict[str, RunSpec]:
    """The study's RunSpecs: the teacher's ``preset`` and ``model`` overrides for every row (the
    student's model is derived in :func:`build`), each row's steps and learning rate. The
    student's budget is stage 1 + stage 2, the from-scratch control's too."""
    def spec(steps: int, rate: float) -> RunSpec:
        return RunSpec(preset, (*model, f"train.max_steps={steps}", f"train.lr={rate:g}"))

    return {TEACHER: spec(teacher_steps, lr), STAGE1: spec(stage1_steps, stage1_lr), LONG: spec(teacher_steps, lr),
            SCRATCH: spec(stage1_steps + stage2_steps, lr),
            **{name: spec(stage2_steps, stage2_lr) for name in DISTILLED}}


def _with_model(cfg: RunConfig, model: ModelConfig) -> RunConfig:
    return dataclasses.replace(cfg, model=model)


def sibling(cfg: RunConfig, run: str) -> Path:
    """The directory of ``run`` at the seed of ``cfg``'s run (``OUT/RUN/seed-s``)."""
    own = Path(cfg.train.out_dir)
    return own.parent.parent / run / own.name


def read_selection(stage1_dir: Path) -> Optional[Selection]:
    path = stage1_dir / SELECTION_FILE
    return Selection.from_dict(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else None


def build(study: Study, size: str, out_dir: Path, seed: int, overrides: Sequence[str]) -> dict[str, RunConfig]:
    """The size's preset configs, every row but the teacher with the student's model: F = ∅
    for stage 1, the seed's selected F for the hybrid rows (the uniform interleave until the
    selection is made; :func:`prepare` replaces it then)."""
    configs = preset_configs(study.size(size), out_dir, seed, overrides)
    teacher = configs[TEACHER].model
    selection = read_selection(run_dir(out_dir, STAGE1, seed))
    n_blocks = len(block_paths(teacher))
    layers = selection.layers if selection is not None else uniform_layers(n_blocks, SETTINGS.keep_count(n_blocks))
    return {name: cfg if name == TEACHER else
            _with_model(cfg, student_config(teacher, SETTINGS.mixer, [] if name == STAGE1 else layers))
            for name, cfg in configs.items()}


def _finished(run_dir: Path, run: str, needed_by: str) -> Path:
    """``run_dir`` when it holds a finished run, else an error saying what to train first."""
    summary = run_dir / "summary.json"
    data = json.loads(summary.read_text(encoding="utf-8")) if summary.is_file() else {}
    if not data or data.get("steps") != data.get("max_steps"):
        raise LoopLMError(f"{needed_by} starts from the finished {run} run of its seed, and {run_dir} holds none: "
                          f"run the study without --variants, or with {run} first")
    return run_dir


def _weights(run_dir: Path, run: str, needed_by: str) -> Path:
    """``run_dir``, the seed's finished ``run``, with the weights ``needed_by`` starts from.

    A finished run's records can outlive its checkpoints: .gitignore keeps checkpoints out,
    and a machine that keeps a checkout's untracked files but not its ignored ones loses
    them between sessions. Such a run is trained again here from the config it recorded:
    the same seed, data order and steps give the same run (checked: its final training and
    validation losses), so the rows already trained from it stay valid."""
    _finished(run_dir, run, needed_by)
    if has_checkpoints(run_dir):
        return run_dir
    recorded = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    cfg = RunConfig.from_dict(recorded["config"])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(run_dir)))
    logger.warning("%s: the finished %s run has no checkpoints; training it again for %s", run_dir, run, needed_by)
    hooked = trainer(run, cfg, False, False)
    summary = (hooked if hooked is not None else Trainer(cfg, progress=False)).fit()
    for key in ("train_loss", "val_loss"):
        if not math.isclose(summary[key], recorded[key], rel_tol=1e-6, abs_tol=1e-9):
            raise LoopLMError(
                f"{run_dir}: trained again for its weights, the {run} run reached {key} {summary[key]!r}, not "
                f"its recorded {recorded[key]!r}: its seed's later rows started from the recorded run; delete "
                f"that seed's runs (OUT/*/{run_dir.name}) to train them all again")
    return run_dir


def _teacher_model(cfg: RunConfig) -> ModelConfig:
    teacher_dir = _finished(sibling(cfg, TEACHER), TEACHER, "the student")
    saved = json.loads((teacher_dir / "summary.json").read_text(encoding="utf-8"))["config"]
    return RunConfig.from_dict(saved).model


def selection_of(cfg: RunConfig) -> Selection:
    """The seed's F: read from its stage-1 run, or chosen now (LT2 §5, the KL-guided selector
    on the stage-1 student, held-out batches of the teacher's data) and written there."""
    stage1_dir = sibling(cfg, STAGE1)
    selection = read_selection(stage1_dir)
    if selection is None:
        _finished(stage1_dir, STAGE1, "the selection of F")
        teacher = load_teacher(_weights(sibling(cfg, TEACHER), TEACHER, "the selection of F"))
        selection = choose_layers(teacher, SETTINGS, cfg.data, cfg.train.batch_size // cfg.train.grad_accum,
                                  cfg.train.device, stage1_dir)
        write_selection(selection, stage1_dir / SELECTION_FILE)
    return selection


def prepare(name: str, cfg: RunConfig) -> Optional[RunConfig]:
    """Before a row trains: stage 1 needs the seed's teacher; a hybrid row gets the seed's
    selected F (the config it trains with); a distilled row records in ``distill.json``
    how it is trained."""
    if name == TEACHER:
        return None
    if name == STAGE1:
        _finished(sibling(cfg, TEACHER), TEACHER, STAGE1)
        return None
    selection = selection_of(cfg)
    cfg = _with_model(cfg, student_config(_teacher_model(cfg), SETTINGS.mixer, selection.layers))
    if name in DISTILLED:
        record = {"teacher": str(sibling(cfg, TEACHER)), "stage1": str(sibling(cfg, STAGE1)),
                  "selection": selection.to_dict(),
                  "distill": {k: v for k, v in _kd_settings(name).to_dict().items() if k in RECORDED},
                  "lengths": list(SETTINGS.stage_lengths(cfg.data.seq_len))}
        Path(cfg.train.out_dir).mkdir(parents=True, exist_ok=True)
        write_text(Path(cfg.train.out_dir) / "distill.json", json.dumps(record, indent=2) + "\n", atomic=True)
    return cfg


def _kd_settings(name: str) -> DistillConfig:
    return dataclasses.replace(SETTINGS, kd=dataclasses.replace(SETTINGS.kd, schedule=DISTILLED[name]))


def trainer(name: str, cfg: RunConfig, resume: bool, progress: bool) -> Optional[Trainer]:
    """The study's ``trainer`` hook: stage 1 (alignment to the seed's teacher) and stage 2 (KD
    from the seed's stage-1 student); None for the rows trained on the next-token loss."""
    if name != STAGE1 and name not in DISTILLED:
        return None
    teacher = load_teacher(_weights(sibling(cfg, TEACHER), TEACHER, name))
    if name == STAGE1:
        return alignment_trainer(cfg, teacher, lambda student: init_student(student, teacher), resume=resume,
                                 progress=progress)
    aligned = LoopLM.from_pretrained(_weights(sibling(cfg, STAGE1), STAGE1, name))
    settings = _kd_settings(name)
    return kd_trainer(cfg, teacher, lambda student: init_student(student, teacher, linear_from=aligned),
                      kd=settings.kd, lengths=settings.stage_lengths(cfg.data.seq_len), resume=resume,
                      progress=progress)


# ---------------------------------------------------------------------- measures
@torch.no_grad()
def per_loop_val_loss(path: Path) -> list[float]:
    """Mean next-token loss of the readout after each loop iteration τ = 1..T,
    head(norm(coda(h^(τ)))) (``LoopLM.loop_logits``), on the run's held-out batches (those of
    its ``val_loss``, so the last equals it); one value for a model without a loop."""
    from looplm.data import data_tokenizer, validation_batches
    from looplm.eval.load import load_run

    loaded = load_run(path)
    model, cfg = loaded.model, loaded.config
    batches = validation_batches(cfg.data, data_tokenizer(cfg.data), cfg.train.batch_size // cfg.train.grad_accum)
    totals: Optional[list[float]] = None
    for x, y in batches:
        out = model(x, output_states=True)
        logits = model.loop_logits(x, out.states[1:]) if out.states is not None else [out.logits]
        losses = [F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1)).item() for z in logits]
        totals = losses if totals is None else [a + b for a, b in zip(totals, losses)]
    return [t / len(batches) for t in totals or []]


def tokens_to_reach(curve: Sequence[Sequence[float]], target: float) -> Optional[float]:
    """The tokens at which a validation curve [[tokens, loss], ...] first reaches ``target``,
    interpolated linearly between evaluations (the first evaluation's tokens when it is
    already there); None when it never does."""
    previous = None
    for tokens, loss in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(tokens)
            (t0, l0) = previous
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        previous = (tokens, loss)
    return None


def _stage1_summary(run: Run) -> dict[str, Any]:
    return json.loads((sibling(run.config, STAGE1) / "summary.json").read_text(encoding="utf-8"))


def training_flops(run: Run) -> list[float]:
    """The row's cumulative training FLOPs after each step 0 … steps (default convention):
    a row trained on the next-token loss its model's training step; stage 1 and a distilled
    row's stage 2 their steps with the teacher's forwards (:mod:`looplm.distill.flops`); a
    distilled row's start is its stage 1's total (the curve continues it)."""
    cfg = run.config
    steps, seq_len, batch = int(run.summary["steps"]), cfg.data.seq_len, cfg.train.batch_size
    if run.name not in (STAGE1, *DISTILLED):
        return [_per_token(cfg) * batch * seq_len * s for s in range(steps + 1)]
    teacher_model = _teacher_model(cfg)
    teacher = build_meta_model(teacher_model)
    if run.name == STAGE1:
        return alignment_flops(teacher, build_meta_model(cfg.model), seq_len, batch, steps)
    summary = _stage1_summary(run)
    stage1 = RunConfig.from_dict(summary["config"])
    start = alignment_flops(teacher, build_meta_model(stage1.model), stage1.data.seq_len, stage1.train.batch_size,
                            int(summary["steps"]))[-1]
    kd = kd_flops(teacher, build_meta_model(cfg.model), seq_len, batch, steps, _kd_settings(run.name).kd,
                  SETTINGS.stage_lengths(seq_len))
    return [start + f for f in kd]


def measure(run: Run) -> Measures:
    """Validation loss (the held-out batches of the teacher's data config, the same for every
    row), per loop τ; the student's tokens (stage 1 + stage 2 for a distilled row: the
    teacher's are a sunk cost, as Ouro's are in LT2) and its training FLOPs, the teacher's
    forwards during distillation included (:func:`training_flops`); the held-out top-k KL
    to the teacher (distilled rows); for the hybrid rows trained after it (:data:`MATCHED`),
    the tokens the from-scratch hybrid at the teacher's budget needed to reach this loss
    (``match_tokens``), that minus this row's own (``saved_tokens``), and the FLOPs those
    tokens cost that hybrid minus this row's (``saved_flops``)."""
    per_step = run.config.train.batch_size * run.config.data.seq_len
    offset = int(_stage1_summary(run)["tokens_seen"]) if run.name in DISTILLED else 0
    evals, val_loss = validation(run)
    tokens = offset + int(run.summary.get("tokens_seen", run.summary["steps"] * per_step))
    flops = training_flops(run)
    scalars: dict[str, Any] = {"val_loss": val_loss, "tokens": tokens, "train_flops": flops[-1]}
    scalars.update({f"val_loss_loop{t}": v for t, v in enumerate(per_loop_val_loss(run.run_dir), 1)})
    kd = [e["kd_final"] for e in run.events("distill_eval") if e.get("kd_final") is not None]
    scalars["kd_final"] = kd[-1] if kd else None
    long_run = sibling(run.config, LONG)
    match = None
    if run.name in MATCHED and (long_run / "metrics.jsonl").is_file() and val_loss is not None and math.isfinite(val_loss):
        # every row reads batches of one shape: the long run's tokens per step are this run's
        curve = [[e["step"] * per_step, e["val_loss"]] for e in events_by_step(long_run / "metrics.jsonl", "eval")
                 if e.get("val_loss") is not None]
        match = tokens_to_reach(curve, val_loss)
    scalars["match_tokens"] = match
    scalars["saved_tokens"] = None if match is None else match - tokens
    scalars["saved_flops"] = None if match is None else match * _per_token(run.config) - flops[-1]
    return {"scalars": scalars,
            "series": {"val_loss_tokens": [[offset + e["step"] * per_step, e["val_loss"]] for e in evals],
                       "val_loss_flops": [[flops[min(e["step"], len(flops) - 1)], e["val_loss"]] for e in evals]},
            "notes": []}


def _per_token(cfg: RunConfig) -> float:
    """Training FLOPs per token of ``cfg``'s model on the next-token loss (a hybrid row's is
    the seed's from-scratch hybrid's: the same F)."""
    return count_flops(build_meta_model(cfg.model), cfg.data.seq_len, batch=cfg.train.batch_size).training_per_token


def notes(result) -> str:
    """The seeds' kept-attention blocks (F) and the selector's scores."""
    selections = {seed: read_selection(run_dir(result.out_dir, STAGE1, seed)) for seed in result.seeds}
    if not any(selections.values()):
        return ""
    lines = ["Kept softmax attention (F, LT2's KL-guided selector on the stage-1 student; score = KL drop when the "
             "block's attention is restored):", ""]
    for seed, selection in selections.items():
        if selection is None:
            continue
        scores = ", ".join(f"block {b}: {s:+.4f}" for b, s in selection.scores.items())
        lines.append(f"- seed {seed}: blocks {selection.layers} ({selection.selector}; all-linear KL "
                     f"{selection.base_kl:.4f}; {scores})" if selection.base_kl is not None else
                     f"- seed {seed}: blocks {selection.layers} ({selection.selector})")
    return "\n".join(lines)
