"""Run a study (``looplm study NAME``): every configuration at every seed, then the tables and figures.

For each seed (outer loop, so an interrupted study already holds whole seeds) and each run
of the chosen size, the runner trains ``out_dir/RUN/seed-S`` or reuses it
(:mod:`looplm.study.runs`: a finished run is read back, an interrupted one resumes from its
checkpoint, a run of other settings is refused before anything trains), measures it with
the study's ``measure`` (cached in the run's ``study.json``, so a reused run is not probed
again) and, after every seed (the tables of the seeds done so far; the figures at the end),
writes into ``out_dir``:

- ``results.md``: command, machine, settings, one row per variant with each metric's mean ±
  standard deviation over seeds, the paper's numbers beside them, the deviations;
- ``results.csv``: one row per variant × metric (mean, std, every seed's value, the paper's);
- ``runs.csv``: one row per run × seed with everything measured;
- ``paired.csv``: every variant against the reference variant, per metric, paired by seed
  (the per-seed differences, how many favour the variant, whether they are under 2 sd);
- ``series.csv``: every run's curves (learning curves, accuracy against α, a measure's
  per-iteration values), one row per run × seed × series × point (x, y);
- the study's figures (``*.png``) when matplotlib is installed;
- ``lr-sweep.md`` / ``lr-sweep.csv`` when the size sweeps learning rates first
  (:mod:`looplm.study.sweep`).

A size with ``max_seeds`` adds seeds one at a time (when none were given explicitly) while
a comparison's paired difference on the primary metric (:func:`~looplm.study.results.paired`)
is under two standard deviations; an added seed trains the rows of those comparisons only (every row when the
study has a ``prepare`` hook, whose runs may start from another row's run of the seed).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from looplm.artifacts import CheckpointError, write_text
from looplm.config_base import ConfigError
from looplm.ladder.rungs import RUNGS
from looplm.ladder.runner import PathLike
from looplm.study.definition import Measures, Study, variant_of
from looplm.study.fingerprint import code_fingerprint
from looplm.study.plots import write_plots
from looplm.study.results import (
    INCOMPLETE,
    PAIRED_FIELDS,
    SERIES_FIELDS,
    SUMMARY_FIELDS,
    StudyResult,
    csv_text,
    paired,
    paired_rows,
    results_markdown,
    run_rows,
    series_rows,
    summary_rows,
    tables_final,
)
from looplm.study.runs import MEASURES_FILE, Run, finished_run, machine_info, train_or_reuse, validation
from looplm.study.studies import get_study, ladder_study
from looplm.study.sweep import run_lr_sweep, with_lr
from looplm.train.checkpoint import has_checkpoints

if TYPE_CHECKING:
    from looplm.config import RunConfig

logger = logging.getLogger("looplm")

PathLike = Union[str, os.PathLike]


def resolve_seeds(seeds: Union[int, Sequence[int]]) -> list[int]:
    """``N`` means seeds 0 … N−1; a sequence is taken as given (distinct integers >= 0)."""
    if isinstance(seeds, bool):
        raise ConfigError("seeds", seeds, "an integer >= 1 (seeds 0 … N-1) or a list of distinct seeds")
    if isinstance(seeds, int):
        if seeds < 1:
            raise ConfigError("seeds", seeds, "an integer >= 1 (seeds 0 … N-1)")
        return list(range(seeds))
    seeds = list(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ConfigError("seeds", seeds, "distinct integers >= 0")
    return seeds


def select_variants(configs: dict[str, "RunConfig"], variants: Sequence[str]) -> dict[str, "RunConfig"]:
    """The runs of ``configs`` (run name -> config) that belong to ``variants``, in study order."""
    known = list(dict.fromkeys(variant_of(run) for run in configs))
    unknown = [v for v in variants if v not in known]
    if not variants or unknown:
        raise ConfigError("variants", list(variants), "one or more of " + ", ".join(known))
    return {run: cfg for run, cfg in configs.items() if variant_of(run) in variants}


def set_threads(threads: Optional[int]) -> None:
    """``torch.set_num_threads``: single-thread speed decides a CPU study's wall time."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError("threads", threads, "an integer >= 1 (torch intra-op threads)")
    torch.set_num_threads(threads)


def run_study(
    study: Union[str, Study], out_dir: Optional[PathLike] = None, *, size: str = "default",
    seeds: Union[int, Sequence[int], None] = None, overrides: Sequence[str] = (), threads: Optional[int] = None,
    command: Optional[str] = None, progress: bool = False, variants: Optional[Sequence[str]] = None,
) -> StudyResult:
    """Train (or reuse) every run of ``study`` at ``size`` for each seed and write the results.

    study: a :class:`Study` or a name of :data:`~looplm.study.STUDIES`. out_dir: default
    ``runs/study-NAME[-SIZE]``. seeds: N (seeds 0 … N−1) or a list; default the size's.
    overrides: ``key=value`` fields shared by every run (not the fields the variants set).
    threads: torch threads. command: recorded in results.md (default: the equivalent
    ``looplm study`` call). variants: train and tabulate only these (default: all)."""
    study = get_study(study, size) if isinstance(study, str) else study
    if study.measure is not None:  # keyed by the source this process loaded, not by a later edit of it
        measure_fingerprint(study.measure)
    spec = study.size(size)
    extend = seeds is None and spec.max_seeds is not None  # seeds given explicitly are run as given
    seeds = resolve_seeds(spec.seeds if seeds is None else seeds)
    set_threads(threads)
    out_dir = Path(out_dir if out_dir is not None else default_out(study.name, size))

    def configs_at(seed: int) -> dict[str, "RunConfig"]:
        by_run = study.configs(size, out_dir, seed, overrides)
        by_run = select_variants(by_run, variants) if variants is not None else by_run
        return {name: with_lr(cfg, chosen[name]) if name in chosen else cfg for name, cfg in by_run.items()}

    chosen: dict[str, float] = {}
    configs = {seed: configs_at(seed) for seed in seeds}  # validated up front
    if command is None:
        command = equivalent_command(study.name, size, out_dir, None if extend else seeds, overrides, threads, variants)
    start = time.perf_counter()
    # a part of a study (--variants) never writes over the final tables of the whole study: a
    # lane restarted after the other lane wrote the whole table would leave half of it
    keep_tables = variants is not None and tables_final(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not keep_tables:
        write_text(out_dir / INCOMPLETE, f"{command}\nstarted {time.strftime('%Y-%m-%d %H:%M:%S')}: the tables here "
                   "are not final until a run of the whole study (no --variants) finishes\n", atomic=True)
    if spec.sweep is not None:
        chosen = run_lr_sweep(study, size, out_dir, overrides, list(configs[seeds[0]]),
                              lambda name, seed, cfg: prepare_and_train(study, name, seed, cfg, finished_run(cfg),
                                                                        progress),
                              lambda run: sweep_measure(study, run), write_tables=not keep_tables)
        configs = {seed: configs_at(seed) for seed in seeds}
    finished = {(run, seed): reusable_run(study, cfg) for seed, by_run in configs.items()
                for run, cfg in by_run.items()}
    runs: dict[str, list[Run]] = {name: [] for name in configs[seeds[0]]}
    measures: dict[str, list[Measures]] = {name: [] for name in runs}
    done, i = 0, 0
    while i < len(seeds):
        seed = seeds[i]
        for name, cfg in configs[seed].items():
            done += 1
            logger.info("study %s (%s): run %d/%d: %s, seed %d", study.name, size, done,
                        sum(len(configs[s]) for s in seeds), name, seed)
            run = prepare_and_train(study, name, seed, cfg, finished[(name, seed)], progress)
            runs[name].append(run)
            measures[name].append(measure_run(study, run))
        result = StudyResult(study=study, size=size, out_dir=out_dir, seeds=seeds[:i + 1], runs=runs,
                             measures=measures, command=command, overrides=tuple(overrides),
                             machine=machine_info(next(iter(runs.values()))[0].device))
        i += 1
        rows = undecided_variants(result) if i == len(seeds) and extend and len(seeds) < spec.max_seeds else set()
        if rows:
            seed = max(seeds) + 1
            logger.info("study %s (%s): a difference of %s is under two standard deviations after %d seeds: "
                        "adding seed %d for %s", study.name, size, ", ".join(sorted(rows)), len(seeds), seed,
                        "every row" if study.prepare is not None else "them")
            keep = set(result.variants) if study.prepare is not None else rows
            seeds.append(seed)
            configs[seed] = {run: cfg for run, cfg in configs_at(seed).items() if variant_of(run) in keep}
            finished.update({(run, seed): reusable_run(study, cfg) for run, cfg in configs[seed].items()})
        if not keep_tables:  # an interrupted study leaves whole seeds' tables
            written = write_results(result, figures=i == len(seeds))
    if variants is None:  # the whole study: its tables are final
        (out_dir / INCOMPLETE).unlink(missing_ok=True)
    if keep_tables:
        logger.info("study %s (%s) done in %.0f s; the whole study's tables in %s are final: this part (--variants "
                    "%s) left them as they are", study.name, size, time.perf_counter() - start, out_dir,
                    ",".join(variants))
    else:
        logger.info("study %s (%s) done in %.0f s; wrote %s", study.name, size, time.perf_counter() - start,
                    ", ".join(str(p) for p in written))
    return result


def reusable_run(study: Study, cfg: "RunConfig") -> Optional[dict]:
    """The summary of ``cfg``'s finished run to read back (:func:`finished_run`), or None to
    train it. A finished run that was never measured (no ``study.json``) and has lost its
    checkpoints is trained again: its records alone cannot give the study's measures. A
    machine that keeps a checkout's untracked files but not its ignored ones (checkpoints,
    .gitignore) leaves one where a session ended between training and measuring; committed
    records always hold their measures (``queue.sh stage``), so none of them is retrained."""
    summary = finished_run(cfg)
    run_dir = Path(cfg.train.out_dir)
    if summary is None or study.measure is None or (run_dir / MEASURES_FILE).is_file() or has_checkpoints(run_dir):
        return summary
    logger.warning("%s: a finished run never measured, without its checkpoints: training it again", run_dir)
    return None


def prepare_and_train(study: Study, name: str, seed: int, cfg: "RunConfig", summary: Optional[dict],
                      progress: bool) -> Run:
    """Run ``name`` at ``seed``: read back when ``summary`` (its finished run) is given, else
    the study's ``prepare`` first (e.g. a converted start made from an earlier run of this
    seed; the config it returns, if any, replaces ``cfg``), then trained or resumed (by the
    study's ``trainer`` hook where it has one)."""
    if study.prepare is not None and summary is None:
        prepared = study.prepare(name, cfg)
        if prepared is not None and prepared != cfg:
            cfg, summary = prepared, finished_run(prepared)
    return train_or_reuse(name, seed, cfg, summary, progress=progress, trainer=study.trainer)


def undecided_variants(result: StudyResult) -> set[str]:
    """Both rows of every comparison whose paired difference on the primary metric is under
    two standard deviations (or has too few seeds to tell)."""
    metric = result.study.primary
    return {row for p in paired(result) if metric is not None and p.metric.key == metric.key and p.undecided
            for row in (p.variant, p.reference)}


def sweep_measure(study: Study, run: Run) -> Measures:
    """What the learning-rate sweep reads of a run: its primary metric. A final validation
    loss is read from the run's last eval record (every study's measure reports that as
    ``val_loss``) rather than measured: a study's measure (probes, test-time curves) costs
    minutes per run that the sweep never reads."""
    if study.primary is not None and study.primary.key == "val_loss":
        return {"scalars": {"val_loss": validation(run)[1]}, "series": {}, "notes": []}
    return measure_run(study, run)


def measure_run(study: Study, run: Run) -> Measures:
    """The study's measures of a run, read from its ``study.json`` when the same measure code
    took them at the same final step (:mod:`looplm.study.fingerprint`), else measured and
    stored there.

    A run two studies share (one run directory, reached by a link from the other study's)
    keeps each study's measures: the first study's at the top level of ``study.json``, every
    other's under ``others`` by study name, so neither re-measures over the other."""
    path = run.run_dir / MEASURES_FILE
    key = {"study": study.name, "measure": getattr(study.measure, "__qualname__", ""),
           "code": measure_fingerprint(study.measure), "steps": run.summary.get("steps")}
    # a run trained just now: nothing stored of an earlier run in its directory counts
    held = json.loads(path.read_text(encoding="utf-8")) if run.reused and path.is_file() else {}
    mine = held.get("study", study.name) == study.name  # the top-level entry is this study's
    stored = held if mine else held.get("others", {}).get(study.name)
    if stored and {k: stored.get(k) for k in key} == key:
        return stored["measures"]
    try:
        measures = study.measure(run)
    except CheckpointError as e:
        if has_checkpoints(run.run_dir):
            raise
        taken = "no measures" if not stored else f"measures taken by other code ({stored.get('code')})"
        raise CheckpointError(
            f"{run.run_dir} holds a finished run's records without its checkpoints (as committed under "
            f"docs/results) and {taken}: measuring it again needs the model. Tabulate it with the looplm "
            f"version that measured it, or delete {run.run_dir} to train it again") from e
    measures.setdefault("series", {})
    measures.setdefault("notes", [])
    entry = {**key, "measures": measures}
    if mine:
        held = {**entry, **({"others": held["others"]} if held.get("others") else {})}
    else:
        held = {**held, "others": {**held.get("others", {}), study.name: entry}}
    write_text(path, json.dumps(held, indent=1) + "\n", atomic=True)
    return measures


#: the fingerprint, read once per measure and process, not once per run
measure_fingerprint = functools.lru_cache(maxsize=None)(code_fingerprint)


def default_out(name: str, size: str) -> str:
    return f"runs/study-{name}" + ("" if size == "default" else f"-{size}")


def equivalent_command(name, size, out_dir, seeds, overrides, threads, variants=None) -> str:
    """The ``looplm study`` call of these arguments (seeds None: the size's own, extended as it says)."""
    args = ["looplm", "study", name, "--out", str(out_dir)]
    if variants is not None:
        args += ["--variants", ",".join(variants)]
    if size in ("quick", "paper"):
        args.append(f"--{size}")
    elif size != "default":
        args += ["--size", size]
    consecutive = seeds is None or seeds == list(range(len(seeds)))
    if seeds is not None and consecutive:
        args += ["--seeds", str(len(seeds))]
    if threads is not None:
        args += ["--threads", str(threads)]
    text = shlex.join([*args, *overrides])
    return text if consecutive else f"{text}  # Python: run_study(..., seeds={seeds})"


def write_results(result: StudyResult, figures: bool = True) -> list[Path]:
    """results.md, results.csv, runs.csv, paired.csv, series.csv and, with ``figures``, the
    figures (skipped, with a note, without matplotlib)."""
    result.out_dir.mkdir(parents=True, exist_ok=True)
    md = result.out_dir / "results.md"
    write_text(md, results_markdown(result), atomic=True)
    summary = result.out_dir / "results.csv"
    write_text(summary, csv_text(SUMMARY_FIELDS, summary_rows(result)), atomic=True)
    per_run = result.out_dir / "runs.csv"
    write_text(per_run, csv_text(*run_rows(result)), atomic=True)
    pairs = result.out_dir / "paired.csv"
    write_text(pairs, csv_text(PAIRED_FIELDS, paired_rows(result)), atomic=True)
    curves = result.out_dir / "series.csv"
    write_text(curves, csv_text(SERIES_FIELDS, series_rows(result)), atomic=True)
    return [md, summary, per_run, pairs, curves, *(write_plots(result) if figures else [])]


# ---------------------------------------------------------------------- the ladder
def run_ladder(
    task: str, budget: int, out_dir: PathLike, *, rungs: Sequence[str] = RUNGS, quick: bool = False,
    steps: Optional[int] = None, seed: int = 0, outer: int = 1, inner: int = 2, overrides: Sequence[str] = (),
    command: Optional[str] = None, progress: bool = False, threads: Optional[int] = None,
) -> StudyResult:
    """Train every rung of the ladder at one seed (or reuse its finished run) and write the
    results: the ladder as a one-seed study (:func:`looplm.study.ladder_study`), each rung in
    ``out_dir/<rung>/seed-<seed>/``.

    See the module docstring for what is written and how an interrupted ladder resumes.
    command: the command line recorded in results.md (default: the equivalent ``looplm
    ladder`` call). progress: the Trainer's progress bar for each rung.
    """
    study = ladder_study(task, budget, rungs=rungs, outer=outer, inner=inner)
    layered = [] if steps is None else [f"train.max_steps={steps}"]
    if command is None:
        command = _equivalent_command(task, budget, out_dir, list(rungs), quick, steps, seed, outer, inner, overrides)
    return run_study(study, out_dir, size="quick" if quick else "default", seeds=[seed],
                     overrides=[*layered, *overrides], threads=threads, command=command, progress=progress)


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
