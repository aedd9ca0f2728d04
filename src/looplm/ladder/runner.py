"""Run the compute-placement ladder (autoregressive-trm.txt §5, App. B) on one character task.

Every rung starts from the same task preset ``task-<task>`` (width, heads, block template,
optimiser, data stream, evaluation problems and seed all identical) and differs only in the
``model`` fields of :func:`~looplm.ladder.rung_model`, which make each forward spend exactly
``budget`` = C block passes (App. B "Compute normalization"; ACT and Q-halt in full-compute
mode, B.1). Each rung is an ordinary :class:`~looplm.train.Trainer` run in ``out_dir/<rung>/``;
the ladder reads the ``task_eval`` events of each run's ``metrics.jsonl`` and writes into
``out_dir``:

- ``results.md``: the command line, the machine, and one row per rung: Table 1's ticks, C,
  parameters, exact match / character accuracy at every α, and the quartile (Fig. 4) and
  last-character (Fig. 5) accuracies at α = 1;
- ``results.csv``: the same numbers, one row per rung × α (final evaluation);
- ``accuracy.png`` (Fig. 6), ``quartiles.png`` (Fig. 4), ``length.png`` and ``last_char.png``
  (Fig. 5), when matplotlib is installed (``pip install 'looplm[plot]'``).

Resuming: rerunning the same ladder finishes what an interrupted one left. A rung whose
directory holds a finished run of the same configuration (``summary.json`` at
``train.max_steps`` and a ``task_eval`` event at that step) is read back, not retrained; a rung
stopped midway continues from its latest checkpoint (the Trainer's exact resume); a directory
holding a run of another configuration is refused before anything trains, so one table never
mixes settings.
"""

from __future__ import annotations

import copy
import csv
import json
import logging
import os
import platform
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from looplm.config import RunConfig, parse_overrides, read_config_source
from looplm.config_base import ConfigError, set_dotted
from looplm.halting.config import HaltingConfig
from looplm.ladder.plots import write_plots
from looplm.ladder.results import CSV_FIELDS, Ladder, LadderRung, results_markdown, results_rows
from looplm.ladder.rungs import MECHANISMS, RUNGS, rung_model
from looplm.tasks.config import CHARACTER_TASKS
from looplm.train import Trainer
from looplm.train.checkpoint import (
    CONFIG_FILE,
    config_differences,
    has_checkpoints,
    resolve_checkpoint,
    with_defaults,
)
from looplm.train.metrics import read_metrics

logger = logging.getLogger("looplm")

#: ``--quick``: all seven rungs of any task in under 20 minutes on 2 CPU cores. Measured on
#: 2 cores of an idle AMD EPYC (torch 2.13, fp32): a training step takes 0.13-0.18 s on
#: addition (the longest rows) and 0.08-0.12 s on copy / reverse for every rung; an evaluation
#: (5 α × 50 problems) about 2.5 s. The dense rung took 82 s on addition and 65 s on copy, so
#: a ladder takes about 10 minutes (addition) or 6-7 minutes (copy, reverse). The model, batch,
#: lr and α grid stay the preset's (the paper's); the run is shorter and evaluated on fewer
#: problems, so expect lower accuracies than after the full 2000 steps (dense copy: 89% of
#: characters right at α = 1 after 500).
QUICK_OVERRIDES = (
    "train.max_steps=500",
    "train.eval_every=100",
    "train.save_every=100",
    "train.keep_last=1",
    "data.task.eval_samples=50",
    "data.val_batches=2",
)

#: Model fields each rung sets; overriding them would break the compute match.
RUNG_FIELDS = ("layout", "step_embeddings", "streams", "halting", "topology")

#: Halting fields an override may still set (``model.halting.init_bias=-3``): they change how
#: a rule starts or weighs its loss, not the compute; applied to every rung whose rule has it.
HALTING_TUNABLES = ("init_bias", "epsilon", "loss_weight")

PathLike = Union[str, os.PathLike]


# ---------------------------------------------------------------------- configs
def ladder_configs(
    task: str, budget: int, out_dir: PathLike, *, rungs: Sequence[str] = RUNGS, quick: bool = False,
    steps: Optional[int] = None, seed: int = 0, outer: int = 1, inner: int = 2, overrides: Sequence[str] = (),
) -> dict[str, RunConfig]:
    """The RunConfig of every rung, validated before anything trains.

    Layers, last wins: the preset ``task-<task>``; :data:`QUICK_OVERRIDES` when ``quick``;
    ``steps`` (train.max_steps); ``seed`` (train.seed for init, data.seed for the training
    stream and the fixed evaluation problems); ``overrides`` (``key=value``); then the rung's
    model fields and ``train.out_dir = out_dir/<rung>``, which overrides may not touch
    (except :data:`HALTING_TUNABLES`, set on every rung with a halting rule).
    """
    if task not in CHARACTER_TASKS:
        raise ConfigError("task", task, "one of " + ", ".join(CHARACTER_TASKS) + " (a character task of App. B.3)")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError("budget", budget, "an integer >= 1 (block passes per forward)")
    rungs = list(rungs)
    unknown = [r for r in rungs if r not in MECHANISMS]
    if not rungs or unknown or len(set(rungs)) != len(rungs):
        raise ConfigError("rungs", rungs, "distinct names out of " + ", ".join(RUNGS))
    for name, value in (("outer", outer), ("inner", inner)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, value, "an integer >= 1 (nested two-stream steps)")

    layered = list(QUICK_OVERRIDES) if quick else []
    if steps is not None:
        layered.append(f"train.max_steps={steps}")
    layered += [f"train.seed={seed}", f"data.seed={seed}"]
    pairs = parse_overrides([*layered, *overrides])
    halting = {key.split(".")[2]: value for key, value in pairs if _halting_tunable(key)}
    pairs = [(key, value) for key, value in pairs if not _halting_tunable(key)]  # the layered ones stay first
    for key, value in pairs[len(layered):]:
        _refuse_rung_owned(key, value)
    base = read_config_source(f"task-{task}")
    for key, value in pairs:
        set_dotted(base, key, value)

    configs = {}
    for rung in rungs:
        fields = copy.deepcopy(rung_model(rung, budget, outer=outer, inner=inner, full_compute=True))
        rule = HaltingConfig.kinds()[fields["halting"]["kind"]]
        fields["halting"].update({key: value for key, value in halting.items() if key in rule.keys()})
        data = copy.deepcopy(base)
        data["model"].update(fields)  # each field replaced whole, never merged with the preset's
        data["train"]["out_dir"] = str(Path(out_dir) / rung)
        configs[rung] = RunConfig.from_dict(data)
    return configs


def _halting_tunable(key: str) -> bool:
    parts = key.split(".")
    return len(parts) == 3 and parts[:2] == ["model", "halting"] and parts[2] in HALTING_TUNABLES


def _refuse_rung_owned(key: str, value: Any) -> None:
    parts = key.split(".")
    if parts[0] == "model" and len(parts) > 1 and parts[1] in RUNG_FIELDS:
        raise ConfigError(key, value, "not overridden in a ladder: each rung sets model."
                          + ", model.".join(RUNG_FIELDS) + " to spend the budget (use --budget, --outer, --inner; "
                          "model.halting." + ", model.halting.".join(HALTING_TUNABLES) + " may be set)")
    if key == "train.out_dir":
        raise ConfigError(key, value, "not overridden in a ladder: each rung trains in OUT/<rung> (use --out)")


# ---------------------------------------------------------------------- running
def run_ladder(
    task: str, budget: int, out_dir: PathLike, *, rungs: Sequence[str] = RUNGS, quick: bool = False,
    steps: Optional[int] = None, seed: int = 0, outer: int = 1, inner: int = 2, overrides: Sequence[str] = (),
    command: Optional[str] = None, progress: bool = False,
) -> Ladder:
    """Train every rung of the ladder (or reuse its finished run) and write the results.

    See the module docstring for what is written and how an interrupted ladder resumes.
    command: the command line recorded in results.md (default: the equivalent ``looplm
    ladder`` call). progress: the Trainer's progress bar for each rung.
    """
    out_dir = Path(out_dir)
    configs = ladder_configs(task, budget, out_dir, rungs=rungs, quick=quick, steps=steps, seed=seed,
                             outer=outer, inner=inner, overrides=overrides)
    finished = {rung: _finished_run(cfg) for rung, cfg in configs.items()}  # refuses foreign runs up front
    if command is None:
        command = _equivalent_command(task, budget, out_dir, list(configs), quick, steps, seed, outer, inner, overrides)
    start = time.perf_counter()
    results = []
    for i, (rung, cfg) in enumerate(configs.items(), 1):
        head = (f"ladder {task} C={budget}: rung {i}/{len(configs)} {rung} "
                f"(layout {cfg.model.layout}, {cfg.model.block_passes} block passes)")
        summary = finished[rung]
        if summary is None:
            resume = has_checkpoints(cfg.train.out_dir)
            logger.info("%s: %s in %s", head, "resuming" if resume else "training", cfg.train.out_dir)
            summary = Trainer(cfg, resume=resume, progress=progress).fit()
        else:
            logger.info("%s: finished run reused from %s", head, cfg.train.out_dir)
        results.append(LadderRung(
            rung=rung, run_dir=Path(cfg.train.out_dir), config=cfg, parameters=summary["parameters"]["total"],
            history=task_history(Path(cfg.train.out_dir) / "metrics.jsonl"), reused=finished[rung] is not None,
            wall_time_s=summary.get("wall_time_s"), device=summary.get("device", cfg.train.device),
        ))
    ladder = Ladder(task=task, budget=budget, out_dir=out_dir, rungs=results, command=command,
                    machine=machine_info(results[0].device))
    written = write_results(ladder)
    logger.info("ladder %s C=%d done in %.0f s; wrote %s", task, budget, time.perf_counter() - start,
                ", ".join(str(p) for p in written))
    return ladder


def task_history(metrics_path: PathLike) -> list[dict[str, Any]]:
    """The ``task_eval`` records of a run, in step order; the last record of a step wins (a
    resumed run logs the steps after its checkpoint again)."""
    by_step = {e["step"]: e for e in read_metrics(metrics_path) if e["event"] == "task_eval"}
    return [by_step[s] for s in sorted(by_step)]


def _finished_run(cfg: RunConfig) -> Optional[dict[str, Any]]:
    """The summary of ``cfg``'s finished run in ``train.out_dir``, or None when it has yet to
    (finish) training. Refuses a directory whose run (finished or checkpointed) has another config."""
    run_dir = Path(cfg.train.out_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else None
    saved = summary["config"] if summary is not None else None
    if saved is None and has_checkpoints(run_dir):
        saved = json.loads((resolve_checkpoint(run_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    if saved is not None:
        _check_same_config(run_dir, saved, cfg)
    if summary is None or summary.get("steps", 0) < cfg.train.max_steps:
        return None
    metrics = run_dir / "metrics.jsonl"
    steps = [e["step"] for e in task_history(metrics)] if metrics.is_file() else []
    return summary if steps and steps[-1] >= cfg.train.max_steps else None


def _check_same_config(run_dir: Path, saved: dict[str, Any], cfg: RunConfig) -> None:
    current = cfg.to_dict()
    differences = []
    for section in ("model", "data", "train"):
        a = with_defaults(saved.get(section, {}), type(getattr(cfg, section)), section)  # fields added since
        a, b = dict(a), dict(current[section])
        if section == "train":  # where the ladder lives does not change what it computes
            a.pop("out_dir", None), b.pop("out_dir", None)
        differences += config_differences(a, b, section)
    if differences:
        raise ConfigError(
            "out_dir", str(run_dir.parent),
            f"a new directory, or one holding this ladder: {run_dir} holds a run of other settings ("
            + "; ".join(differences[:4]) + (" …" if len(differences) > 4 else "")
            + "); choose another --out or delete that run",
        )


def _equivalent_command(task, budget, out_dir, rungs, quick, steps, seed, outer, inner, overrides) -> str:
    args = ["looplm", "ladder", "--task", task, "--budget", str(budget), "--out", str(out_dir)]
    if quick:
        args.append("--quick")
    if list(rungs) != list(RUNGS):
        args += ["--rungs", *rungs]
    if steps is not None:
        args += ["--steps", str(steps)]
    args += ["--seed", str(seed), "--outer", str(outer), "--inner", str(inner), *overrides]
    return shlex.join(args)


def machine_info(device: str) -> dict[str, Any]:
    """What a reader needs to compare timings and reproduce the numbers."""
    info: dict[str, Any] = {
        "looplm": _looplm_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if torch.cuda.is_available() and device != "cpu":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _looplm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("looplm")
    except PackageNotFoundError:
        text = "unknown"
    try:
        described = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).parent,
                                   capture_output=True, text=True, timeout=5)
        if described.returncode == 0 and described.stdout.strip():
            text += f" (git {described.stdout.strip()})"
    except (OSError, subprocess.SubprocessError):
        pass
    return text


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------- results
def write_results(ladder: Ladder) -> list[Path]:
    """results.md, results.csv and the plots (skipped, with a note, without matplotlib)."""
    ladder.out_dir.mkdir(parents=True, exist_ok=True)
    md = ladder.out_dir / "results.md"
    md.write_text(results_markdown(ladder), encoding="utf-8")
    table = ladder.out_dir / "results.csv"
    with open(table, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(results_rows(ladder))
    return [md, table, *write_plots(ladder)]
