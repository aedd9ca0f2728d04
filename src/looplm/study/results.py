"""A finished study as data, and its tables: results.md, results.csv (mean ± std per row and
metric), runs.csv (every run's numbers, one row per run and seed) and series.csv (every
run's curves, one row per point)."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import statistics
from pathlib import Path
from typing import Any, Optional

from looplm.provenance import is_dirty
from looplm.study.definition import Measures, Metric, Study, variant_of
from looplm.study.runs import Run, machine_line


@dataclasses.dataclass
class StudyResult:
    """What ran (``runs[run]``: one :class:`Run` per seed it trained at, ``measures[run]``
    beside them), what was measured, where, and on what machine. ``seeds``: every seed some
    run trained at; a row may have fewer (a seed added while a comparison was undecided
    trains only the rows of such comparisons)."""

    study: Study
    size: str
    out_dir: Path
    seeds: list[int]
    runs: dict[str, list[Run]]
    measures: dict[str, list[Measures]]
    command: str
    machine: dict[str, Any]
    overrides: tuple[str, ...] = ()  # key=value changes to the size, shared by every run

    @property
    def variants(self) -> list[str]:
        return list(dict.fromkeys(variant_of(r) for r in self.runs))

    def row_runs(self, variant: str) -> list[Run]:
        return [r for name, runs in self.runs.items() if variant_of(name) == variant for r in runs]

    def row_seeds(self, variant: str) -> list[int]:
        """The seeds the row trained at."""
        return sorted({r.seed for r in self.row_runs(variant)})

    def scalars(self, variant: str) -> dict[int, dict[str, Optional[float]]]:
        """Per seed the row trained at, the scalars of every part of the row, merged."""
        merged: dict[int, dict[str, Optional[float]]] = {seed: {} for seed in self.row_seeds(variant)}
        for name, measures in self.measures.items():
            if variant_of(name) == variant:
                for run, m in zip(self.runs[name], measures):
                    merged[run.seed].update(m["scalars"])
        return merged

    def values(self, variant: str, key: str) -> list[float]:
        """The row's values of ``key`` over its seeds (seeds where it is undefined left out)."""
        return [s[key] for s in self.scalars(variant).values() if s.get(key) is not None]

    def series(self, variant: str, key: str) -> list[list[list[float]]]:
        out = []
        for name, measures in self.measures.items():
            if variant_of(name) == variant:
                out += [m["series"][key] for m in measures if m["series"].get(key)]
        return out


def mean_std(values: list[float]) -> tuple[Optional[float], Optional[float]]:
    """Mean and sample standard deviation (None from fewer than 2 values)."""
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def _number(value: float, metric: Metric) -> str:
    if metric.percent:
        return f"{100 * value:.1f}"
    return f"{value:.{metric.digits}e}" if metric.sci else f"{value:.{metric.digits}f}"


def cell(values: list[float], metric: Metric, expected: int) -> str:
    """``mean ± std``; ``(n=k)`` where only k of the seeds define the metric; – where none do."""
    mean, std = mean_std(values)
    if mean is None:
        return "–"
    text = _number(mean, metric) + ("" if std is None else f" ± {_number(std, metric)}")
    return text + (f" (n={len(values)})" if len(values) < expected else "")


def _best(result: StudyResult, metric: Metric) -> Optional[str]:
    if metric.better is None:
        return None
    means = {v: mean_std(result.values(v, metric.key))[0] for v in result.variants}
    means = {v: m for v, m in means.items() if m is not None and math.isfinite(m)}
    if len(means) < 2:
        return None
    if len(set(means.values())) == 1:
        return None  # a tie everywhere is no one's best
    pick = min if metric.better == "lower" else max
    return pick(means, key=means.get)


def describe_default(variant: str, runs: list[Run]) -> dict[str, str]:
    """Layout and non-embedding parameters of a row's first run."""
    first = runs[0]
    return {"layout": f"`{first.config.model.layout}`", "params (non-emb)": f"{first.parameters['non_embedding']:,}"}


def shown_metrics(result: StudyResult) -> list[Metric]:
    """The study's metrics that some run measured (the ladder lists every α it may evaluate)."""
    return [m for m in result.study.metrics if any(result.values(v, m.key) for v in result.variants)]


def results_table(result: StudyResult) -> str:
    """The markdown table: one row per variant, its description, each metric's mean ± std
    over seeds (best in bold), the paper's columns, the steps trained and the mean wall time."""
    study = result.study
    describe = study.describe or describe_default
    described = {v: describe(v, result.row_runs(v)) for v in result.variants}
    desc_cols = list(next(iter(described.values()))) if described else []
    papers = [p for p in study.paper_columns if any(v in p.values for v in result.variants)]
    metrics = shown_metrics(result)
    seeds = {v: len(result.row_seeds(v)) for v in result.variants}
    seed_col = ["seeds"] if len(set(seeds.values())) > 1 else []  # rows extended while undecided
    lrs = row_lrs(result)
    lr_col = ["lr"] if len(set(lrs.values())) > 1 else []  # each row's rate from the sweep
    header = ["variant", *desc_cols, *seed_col, *lr_col, *(m.label + (" (%)" if m.percent else "") for m in metrics), *(f"paper: {p.label}" for p in papers),
              "steps", "train time (s)"]
    best = {m.key: _best(result, m) for m in metrics}
    rows = []
    for v in result.variants:
        runs = result.row_runs(v)
        row = [v, *(described[v].get(c, "") for c in desc_cols), *(str(seeds[v]) for _ in seed_col),
               *(lrs[v] for _ in lr_col)]
        for m in metrics:
            text = cell(result.values(v, m.key), m, seeds[v])
            row.append(f"**{text}**" if best[m.key] == v else text)
        row += [p.values.get(v, "–") for p in papers]
        steps = sorted({r.summary.get("steps", 0) for r in runs})
        times = [r.train_time_s for r in runs if r.train_time_s is not None]
        per_seed = sum(times) / seeds[v] if times else None
        time = "–" if per_seed is None else f"{per_seed:.0f}" if per_seed >= 10 else f"{per_seed:.1f}"
        row += ["/".join(str(s) for s in steps), time]
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def row_lrs(result: StudyResult) -> dict[str, str]:
    """Each row's learning rate(s) as trained."""
    return {v: "/".join(f"{lr:g}" for lr in sorted({r.config.train.lr for r in result.row_runs(v)}))
            for v in result.variants}


def results_markdown(result: StudyResult) -> str:
    study, m = result.study, result.machine
    first = next(iter(result.runs.values()))[0].config
    seeds = ", ".join(str(s) for s in result.seeds)
    lines = [
        f"# {study.title}",
        "",
        "```",
        result.command,
        "```",
        "",
        f"- paper: {study.paper}",
        f"- claim tested: {study.claim}",
        f"- size `{result.size}`, seeds {seeds} (each seed: model init, training stream and evaluation problems); "
        f"data `{first.data.source}`, batch {first.train.batch_size}, seq_len {first.data.seq_len}, "
        + (f"lr {first.train.lr:g}, " if len(set(row_lrs(result).values())) == 1 else
           "lr per row (column lr: each run's best rate in lr-sweep.md), ")
        + f"{first.train.max_steps} steps",
        f"- looplm {m['looplm']}, torch {m['torch']}, Python {m['python']}, {m['platform']}",
        f"- machine: {machine_line(m)}",
        f"- trained by: {trained_by(result)}",
        "",
        *([warning, ""] if (warning := dirty_warning(m, result)) else []),
        f"Each cell: mean ± sample standard deviation over {seed_counts(result)} (best mean in bold). "
        f"Runs: `{result.out_dir}/<variant>/seed-<s>/`; every seed's numbers in runs.csv. Train time: seconds "
        "of training steps per seed (over every session of a resumed run; evaluations not counted).",
        "",
        results_table(result),
        "",
    ]
    comparison = paired_table(result)
    if comparison:
        lines += [comparison, ""]
    papers = [p for p in study.paper_columns if any(v in p.values for v in result.variants)]
    if papers:
        lines += ["Paper columns:", ""] + [f"- {p.label}: {p.source}" for p in papers] + [""]
    size_notes = study.sizes[result.size].notes if result.size in study.sizes else ()
    if size_notes:
        lines += [f"Size `{result.size}`:", ""] + [f"- {n}" for n in size_notes] + [""]
    if study.deviations:
        heading = "Deviations from the paper:"
        if result.overrides:  # the list describes the size as defined, not these changes to it
            heading = (f"Deviations from the paper of the `{result.size}` size as defined; this run changed it with "
                       f"`{' '.join(result.overrides)}`:")
        lines += [heading, ""] + [f"- {d}" for d in study.deviations] + [""]
    if study.notes is not None:
        lines += [study.notes(result), ""]
    return "\n".join(lines)


def seed_counts(result: StudyResult) -> str:
    """How many seeds the cells average: all the study's, or each row's where they differ."""
    counts = {len(result.row_seeds(v)) for v in result.variants}
    if len(counts) <= 1:
        return f"the {len(result.seeds)} seed(s)"
    return (f"the row's seeds (column `seeds`: seeds past the first {min(counts)} trained only the rows of a paired "
            "comparison still under two standard deviations)")


def reference_variant(result: StudyResult) -> str:
    """The row the others are compared with, seed by seed: ``study.reference`` when this
    size runs it, else the first variant."""
    ref = result.study.reference
    return ref if ref in result.variants else result.variants[0]


@dataclasses.dataclass(frozen=True)
class Paired:
    """``variant`` against ``reference`` on ``metric``, paired by seed: ``differences``
    (variant − reference, one per seed both define, in seed order), how many of them favour
    the variant (``wins``: lower or higher as the metric says is better; None for a metric
    without a direction) and whether the mean difference is under two standard deviations
    of the differences (``undecided``: a claim resting on it needs more seeds)."""

    variant: str
    reference: str
    metric: Metric
    seeds: list[int]
    differences: list[float]

    @property
    def wins(self) -> Optional[int]:
        if self.metric.better is None:
            return None
        sign = -1 if self.metric.better == "lower" else 1
        return sum(1 for d in self.differences if sign * d > 0)

    @property
    def undecided(self) -> bool:
        mean, std = mean_std(self.differences)
        return mean is None or std is None or abs(mean) < 2 * std

    def verdict(self) -> str:
        """"better in k of n seeds" (or "n seeds" for a metric without a direction)."""
        n = len(self.differences)
        wins = self.wins
        text = f"{n} seed{'s' if n != 1 else ''}" if wins is None else f"better in {wins} of {n} seeds"
        return text + (" (under 2 sd)" if self.undecided else "")


def comparisons(result: StudyResult) -> list[tuple[str, str]]:
    """The (row, reference) pairs of the table: the study's ``comparisons`` whose rows ran,
    else every other row against :func:`reference_variant`."""
    if result.study.comparisons:
        return [(v, r) for v, r in result.study.comparisons if v in result.variants and r in result.variants]
    ref = reference_variant(result)
    return [(v, ref) for v in result.variants if v != ref]


def paired(result: StudyResult) -> list[Paired]:
    """Each of :func:`comparisons`, per shown metric with a direction (lower or higher is
    better: a parameter or FLOP count has no verdict), paired by seed."""
    out = []
    for v, ref in comparisons(result):
        base, mine = result.scalars(ref), result.scalars(v)
        for m in shown_metrics(result):
            if m.better is None:
                continue
            pairs = [(seed, a[m.key] - base[seed][m.key]) for seed, a in mine.items()
                     if seed in base and a.get(m.key) is not None and base[seed].get(m.key) is not None]
            if pairs:
                out.append(Paired(v, ref, m, [s for s, _ in pairs], [d for _, d in pairs]))
    return out


def paired_table(result: StudyResult) -> str:
    """Markdown: per variant and metric, the per-seed differences to the reference and their sign count."""
    rows = paired(result)
    if not rows:
        return ""
    minus = "its reference" if result.study.comparisons else f"`{reference_variant(result)}`"
    lines = [f"Paired by seed, each row minus {minus} (a difference favours the row when "
             "it is lower for a lower-is-better metric, higher otherwise; \"under 2 sd\": the mean difference is "
             "smaller than twice the differences' standard deviation, so the sign is not settled by these seeds):",
             "", "| comparison | metric | per-seed difference | mean | verdict |", "| --- | --- | --- | --- | --- |"]
    for p in rows:
        per_seed = ", ".join(f"{s}: {_number(d, p.metric)}" for s, d in zip(p.seeds, p.differences))
        mean = mean_std(p.differences)[0]
        lines.append(f"| {p.variant} − {p.reference} | {p.metric.label} | {per_seed} | {_number(mean, p.metric)} | {p.verdict()} |")
    return "\n".join(lines)


#: The file a study's directory holds while its tables are not final: written when a study
#: starts, removed when a run of the whole study (no ``--variants``) finishes. The claims
#: read no table that has it (a lane training half of a study writes half a table).
INCOMPLETE = "INCOMPLETE"


def tables_final(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds the final tables of a whole study: its results.md, and no
    :data:`INCOMPLETE` marker."""
    return (out_dir / "results.md").is_file() and not (out_dir / INCOMPLETE).exists()

PAIRED_FIELDS = ("study", "size", "variant", "reference", "metric", "seeds", "differences", "mean", "wins", "n",
                 "undecided")


def paired_rows(result: StudyResult) -> list[dict[str, Any]]:
    """paired.csv: one row per variant × metric against the reference."""
    return [{"study": result.study.name, "size": result.size, "variant": p.variant, "reference": p.reference,
             "metric": p.metric.key, "seeds": " ".join(str(s) for s in p.seeds),
             "differences": " ".join(f"{d:.10g}" for d in p.differences), "mean": mean_std(p.differences)[0],
             "wins": p.wins, "n": len(p.differences), "undecided": p.undecided} for p in paired(result)]


def trained_by(result: StudyResult) -> str:
    """Which looplm versions trained the table's runs, with how many runs each (a run resumed
    under other code counts for each), and how many runs did not record it."""
    counts: dict[str, int] = {}
    unrecorded = 0
    for run in (r for runs in result.runs.values() for r in runs):
        unrecorded += not run.code
        for code in run.code:
            counts[code] = counts.get(code, 0) + 1
    parts = [f"looplm {code} ({n} run{'s' * (n != 1)})" for code, n in counts.items()]
    if unrecorded:
        parts.append(f"{unrecorded} run{'s' * (unrecorded != 1)} trained before runs recorded their code")
    return "; ".join(parts)


def dirty_warning(machine: dict[str, Any], result: Optional[StudyResult] = None) -> Optional[str]:
    """A line for results.md when the tables' code (``machine``) or a run's training code came
    from a working tree with uncommitted changes (``git describe --dirty``): its commit does not
    reproduce the numbers."""
    trained = [code for runs in result.runs.values() for run in runs for code in run.code] if result else []
    dirty = [code for code in [str(machine.get("looplm", "")), *trained] if is_dirty(code)]
    if not dirty:
        return None
    return (f"**Run from a working tree with uncommitted changes ({', '.join(dict.fromkeys(dirty))}): the "
            "commit named does not reproduce these numbers exactly.**")


def summary_rows(result: StudyResult) -> list[dict[str, Any]]:
    """results.csv: one row per variant × metric."""
    rows = []
    for v in result.variants:
        for m in shown_metrics(result):
            values = result.values(v, m.key)
            mean, std = mean_std(values)
            paper = [f"{p.label}: {p.values[v]}" for p in result.study.paper_columns if v in p.values]
            rows.append({"study": result.study.name, "size": result.size, "variant": v, "metric": m.key,
                         "n": len(values), "mean": mean, "std": std, "values": " ".join(f"{x:.10g}" for x in values),
                         "paper": " | ".join(paper)})
    return rows


SUMMARY_FIELDS = ("study", "size", "variant", "metric", "n", "mean", "std", "values", "paper")


def run_rows(result: StudyResult) -> tuple[list[str], list[dict[str, Any]]]:
    """runs.csv: one row per run × seed with every scalar it measured."""
    keys: list[str] = []
    rows = []
    for name, runs in result.runs.items():
        for run, measures in zip(runs, result.measures[name]):
            for k in measures["scalars"]:
                if k not in keys:
                    keys.append(k)
            rows.append({"study": result.study.name, "run": name, "variant": variant_of(name), "seed": run.seed,
                         "steps": run.summary.get("steps"), "parameters": run.parameters["total"],
                         "non_embedding": run.parameters["non_embedding"], "train_time_s": run.train_time_s,
                         "wall_time_s": run.wall_time_s, "reused": run.reused, "code": " → ".join(run.code),
                         **measures["scalars"]})
    fields = ["study", "run", "variant", "seed", "steps", "parameters", "non_embedding", "train_time_s", "wall_time_s", "reused",
              "code", *keys]
    return fields, rows


SERIES_FIELDS = ("study", "run", "variant", "seed", "series", "x", "y")


def series_rows(result: StudyResult) -> list[dict[str, Any]]:
    """series.csv: the curves behind the figures as data, long format: one row per run ×
    seed × series × point (x as the measure gives it: a step, FLOPs, α, a loop step; y blank
    where undefined)."""
    return [{"study": result.study.name, "run": name, "variant": variant_of(name), "seed": run.seed, "series": key,
             "x": x, "y": y}
            for name, runs in result.runs.items() for run, measures in zip(runs, result.measures[name])
            for key, points in measures["series"].items() for x, y in points]


def csv_text(fields, rows) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(fields), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()
