"""One study run: train a configuration or reuse its finished run, resuming an interrupted one.

A study trains many (configuration, seed) pairs, each an ordinary
:class:`~looplm.train.Trainer` run in its own directory. Rerunning a study must finish
what an interrupted one left and never mix settings in one table, so before anything trains:

- a directory holding a finished run of the same configuration (``summary.json`` at
  ``train.max_steps``, and its last task evaluation at that step when the run has a task) is
  read back, not retrained;
- one holding checkpoints of the same configuration resumes from the latest (the Trainer's
  exact resume: the same losses as an uninterrupted run);
- one holding a run of other settings is refused with a ConfigError naming the differences,
  and a finished run trained on other data than this machine's (its sessions' recorded
  corpus and tokenizer, :mod:`looplm.data.identity`: another Python's built-in corpora) too.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from looplm.config import RunConfig
from looplm.config_base import ConfigError
from looplm.data import data_tokenizer
from looplm.data.config import DataConfig
from looplm.data.identity import data_identity, refuse_other_data
from looplm.data.source_kinds import TaskSource
from looplm.provenance import code_version, cpu_name
from looplm.train import Trainer
from looplm.train.checkpoint import CONFIG_FILE, config_differences, has_checkpoints, resolve_checkpoint, with_defaults
from looplm.train.metrics import read_metrics, recorded_data, session_values

logger = logging.getLogger("looplm")

PathLike = Union[str, os.PathLike]


@dataclasses.dataclass
class Run:
    """A trained (or reused) run of one study configuration at one seed."""

    name: str  # the study's run name (a variant, or variant/part)
    seed: int
    run_dir: Path
    config: RunConfig
    summary: dict[str, Any]
    reused: bool

    @property
    def parameters(self) -> dict[str, int]:
        return self.summary["parameters"]

    @property
    def wall_time_s(self) -> Optional[float]:
        """Seconds of the last training session (a resumed run's earlier sessions not counted)."""
        return self.summary.get("wall_time_s")

    @property
    def train_time_s(self) -> Optional[float]:
        """Seconds spent in training steps over every session of the run (kept across resumes;
        evaluations and checkpoints not counted)."""
        return self.summary.get("train_time_s")

    @property
    def device(self) -> str:
        return self.summary.get("device", self.config.train.device)

    @functools.cached_property
    def code(self) -> list[str]:
        """The looplm versions (:func:`looplm.provenance.code_version`) its training sessions
        ran, in order, each once; empty for a run trained before runs recorded it. Read once:
        results.md, its dirty-tree warning and runs.csv each ask, after every seed."""
        return list(dict.fromkeys(session_values(self.run_dir / "metrics.jsonl", "code")))

    def events(self, kind: str) -> list[dict[str, Any]]:
        """The run's ``kind`` events of metrics.jsonl in step order; the last record of a step
        wins (a resumed run logs the steps after its checkpoint again)."""
        return events_by_step(self.run_dir / "metrics.jsonl", kind)

    def events_all(self, kind: str) -> list[dict[str, Any]]:
        """Every ``kind`` event in file order, those a resumed run logged again (steps after
        its checkpoint) replaced by the resumed session's."""
        events = read_metrics(self.run_dir / "metrics.jsonl")
        kept: list[dict[str, Any]] = []
        for e in events:
            if e["event"] == "resume":
                kept = [k for k in kept if k["step"] <= e["step"]]
            elif e["event"] == kind:
                kept.append(e)
        return kept


def events_by_step(metrics_path: PathLike, kind: str) -> list[dict[str, Any]]:
    """``kind`` records of a metrics.jsonl, one per step (the last), in step order."""
    by_step = {e["step"]: e for e in read_metrics(metrics_path) if e["event"] == kind}
    return [by_step[s] for s in sorted(by_step)]


def validation(run: Run) -> tuple[list[dict[str, Any]], Optional[float]]:
    """A run's ``eval`` records that carry a validation loss (step order) and its final
    validation loss: the last of them, else the summary's (what every study reports as
    ``val_loss``, and what the learning-rate sweep ranks)."""
    evals = [e for e in run.events("eval") if e.get("val_loss") is not None]
    return evals, evals[-1]["val_loss"] if evals else run.summary.get("val_loss")


def task_history(metrics_path: PathLike) -> list[dict[str, Any]]:
    """The ``task_eval`` records of a run, in step order (see :func:`events_by_step`)."""
    return events_by_step(metrics_path, "task_eval")


def finished_run(cfg: RunConfig) -> Optional[dict[str, Any]]:
    """The summary of ``cfg``'s finished run in ``train.out_dir``, or None when it has yet to
    (finish) training. Refuses a directory whose run (finished or checkpointed) has another config."""
    run_dir = Path(cfg.train.out_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else None
    saved = summary["config"] if summary is not None else None
    if saved is None and has_checkpoints(run_dir):
        saved = json.loads((resolve_checkpoint(run_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    if saved is not None:
        check_same_config(run_dir, saved, cfg)
    if summary is None or summary.get("steps", 0) < cfg.train.max_steps:
        return None
    recorded = recorded_data(run_dir / "metrics.jsonl")
    if recorded is not None:  # this machine's identity only for a run that recorded one
        refuse_other_data(run_dir, cfg.data, recorded, _data_identity(cfg.data), "tabulate it where the corpus "
                          "and tokenizer are those it trained on, or delete it to train it again")
    if isinstance(cfg.data.parsed_source, TaskSource):  # the table reads the final task evaluation
        metrics = run_dir / "metrics.jsonl"
        steps = [e["step"] for e in task_history(metrics)] if metrics.is_file() else []
        if not steps or steps[-1] < cfg.train.max_steps:
            return None
    return summary


#: where a study trains its learning-rate sweep runs (``out_dir/lr-sweep/lr-RATE/RUN/seed-0``)
SWEEP_DIR = "lr-sweep"
#: a study run's measures, beside its records (:func:`looplm.study.runner.measure_run`)
MEASURES_FILE = "study.json"
#: what a study reads back of a finished run (checkpoints, which .gitignore keeps out, are not)
RECORDS = ("summary.json", "metrics.jsonl", MEASURES_FILE)


def finished_records(root: PathLike) -> list[Path]:
    """The record files (:data:`RECORDS`) of every finished run under ``root``: a run at its
    ``train.max_steps`` and measured — a study run holds its measures (``study.json``), a
    learning-rate sweep run (under ``lr-sweep/``) needs none. What a study reads back instead
    of training, so the files to commit or to bring back from another machine; an unfinished
    run's files are left out (it starts over from its config where its checkpoints are not)."""
    files: list[Path] = []
    for summary in sorted(Path(root).rglob("summary.json")):
        run = summary.parent
        done = json.loads(summary.read_text(encoding="utf-8"))
        finished = done.get("steps", 0) >= done["config"]["train"]["max_steps"]
        if finished and (SWEEP_DIR in run.relative_to(root).parts or (run / MEASURES_FILE).is_file()):
            files += [p for p in (run / name for name in RECORDS) if p.is_file()]
    return files


@functools.lru_cache(maxsize=8)
def _data_identity(data: DataConfig) -> Optional[dict[str, Any]]:
    """This machine's identity of ``data`` (once per data config: a study reads back many runs)."""
    return data_identity(data, data_tokenizer(data))


def check_same_config(run_dir: Path, saved: dict[str, Any], cfg: RunConfig) -> None:
    """Raise ConfigError when the run saved in ``run_dir`` (its config ``saved``) is not ``cfg``
    (where the run lives and fields added to looplm since do not count)."""
    current = cfg.to_dict()
    differences = []
    for section in ("model", "data", "train"):
        a = with_defaults(saved.get(section, {}), type(getattr(cfg, section)), section)  # fields added since
        a, b = dict(a), dict(current[section])
        if section == "train":  # where the study lives does not change what it computes
            a.pop("out_dir", None), b.pop("out_dir", None)
        differences += config_differences(a, b, section)
    if differences:
        study_dir = run_dir.parent.parent if run_dir.name.startswith("seed-") else run_dir.parent
        raise ConfigError(
            "out_dir", str(study_dir),
            f"a new directory, or one holding this study: {run_dir} holds a run of other settings ("
            + "; ".join(differences[:4]) + (" …" if len(differences) > 4 else "")
            + "); choose another --out or delete that run",
        )


def train_or_reuse(name: str, seed: int, cfg: RunConfig, summary: Optional[dict[str, Any]], *,
                   progress: bool = False, trainer: Optional[Callable[..., Optional[Trainer]]] = None) -> Run:
    """Train ``cfg`` (resuming from its checkpoints when there are any) unless ``summary``, its
    finished run found by :func:`finished_run`, is given. ``trainer(name, cfg, resume,
    progress)``: the run's Trainer when it is not ``Trainer(cfg)`` (a study's hook)."""
    run_dir = Path(cfg.train.out_dir)
    if summary is None:
        resume = has_checkpoints(run_dir)
        logger.info("%s seed %d: %s in %s", name, seed, "resuming" if resume else "training", run_dir)
        built = trainer(name, cfg, resume, progress) if trainer is not None else None
        summary = (built if built is not None else Trainer(cfg, resume=resume, progress=progress)).fit()
        return Run(name, seed, run_dir, cfg, summary, reused=False)
    logger.info("%s seed %d: finished run reused from %s", name, seed, run_dir)
    return Run(name, seed, run_dir, cfg, summary, reused=True)


def machine_info(device: str) -> dict[str, Any]:
    """What a reader needs to compare timings and reproduce the numbers."""
    info: dict[str, Any] = {
        "looplm": code_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if torch.cuda.is_available() and device != "cpu":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def machine_line(m: dict[str, Any]) -> str:
    text = f"{m['cpu']}, {m['cpus']} CPUs, {m['torch_threads']} torch threads, device {m['device']}"
    return text + (f" ({m['gpu']})" if "gpu" in m else "")

