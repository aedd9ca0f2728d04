"""What a study is: named configurations trained on the same data, budget and seeds, what is
measured of each run, and the paper's numbers to set beside the table.

A :class:`Study` is data: its :class:`Size` s (``quick`` for tests, ``default`` for this
machine, ``paper`` for the paper's scale) each name the runs (a preset plus ``key=value``
overrides, layered over the size's shared overrides), and the study names the metrics of
its table, the paper's columns and the figures. The runner (:mod:`looplm.study.runner`)
trains every (run, seed) and aggregates mean ± standard deviation over seeds.

A run is named ``variant`` or ``variant/part``: a variant trained on two tasks (LT2's
language modelling and state tracking) has two parts, whose measures share its table row.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

from looplm.config import RunConfig, parse_overrides, read_config_source
from looplm.config_base import ConfigError, set_dotted

if TYPE_CHECKING:
    from looplm.train import Trainer

#: a run's measurements: ``scalars`` (table metrics; None where undefined), ``series`` (name ->
#: [[x, y], ...] for curves) and ``notes`` (markdown lines, e.g. SGT's growth decisions)
Measures = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Metric:
    """A table column: ``key`` in a run's scalars; ``percent`` prints 100·value, ``sci`` in
    scientific notation; ``better`` ("lower" / "higher") marks the best mean in bold."""

    key: str
    label: str
    digits: int = 3
    percent: bool = False
    better: Optional[str] = None
    sci: bool = False


@dataclasses.dataclass(frozen=True)
class PaperColumn:
    """The paper's number for each variant (as printed there), its source (table, row)."""

    label: str
    source: str
    values: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class Curve:
    """A figure: the runs' ``series`` (mean over seeds at each x, band ± std), one line per row."""

    file: str
    series: str
    title: str
    xlabel: str
    ylabel: str
    logx: bool = False
    ylim: Optional[tuple[float, float]] = None


@dataclasses.dataclass(frozen=True)
class Bars:
    """A figure: grouped bars of ``metrics`` (one group each), one bar per row, ± std."""

    file: str
    metrics: tuple[str, ...]
    labels: tuple[str, ...]
    title: str
    ylabel: str


Figure = Union[Curve, Bars]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One configuration of a study: a preset (or YAML path) and the overrides that make it the variant."""

    preset: str
    overrides: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A learning-rate sweep run before a size's seeds: every run at seed 0 at each of
    ``lrs`` under ``overrides`` (a shorter budget); each run then trains every seed at the
    rate with the best primary metric (the study's first metric with a direction), and the
    sweep's table is written beside the results (lr-sweep.md, lr-sweep.csv). ``extend``: a
    run whose best rate is the lowest (highest) it has tried also tries half (twice) that
    rate, up to this many times: an optimum on the sweep's edge has not been found."""

    lrs: tuple[float, ...]
    overrides: tuple[str, ...] = ()
    extend: int = 0

    def __post_init__(self) -> None:
        if len(self.lrs) < 2 or any(not (isinstance(x, (int, float)) and x > 0) for x in self.lrs) \
                or len(set(self.lrs)) != len(self.lrs):
            raise ConfigError("sweep.lrs", list(self.lrs), "two or more distinct learning rates > 0")
        if isinstance(self.extend, bool) or not isinstance(self.extend, int) or self.extend < 0:
            raise ConfigError("sweep.extend", self.extend, "an integer >= 0 (rates added past the edge)")


@dataclasses.dataclass(frozen=True)
class Size:
    """One size of a study: its runs, the overrides they share, the seeds it is meant for and
    its expected wall time (how it was estimated). ``sweep``: a learning-rate sweep that
    picks each run's rate first. ``max_seeds``: when the seeds were not given explicitly,
    seeds are added one at a time up to this many while a comparison's paired difference
    on the primary metric is under two standard deviations (a sign those seeds do not
    settle). ``notes``: how this size departs from what the study's deviations
    describe (its corpus, widths, budget), printed above them in results.md."""

    runs: Mapping[str, RunSpec]
    shared: tuple[str, ...] = ()
    seeds: int = 3
    wall_time: str = ""
    sweep: Optional[Sweep] = None
    max_seeds: Optional[int] = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_seeds is not None and self.max_seeds < self.seeds:
            raise ConfigError("size.max_seeds", self.max_seeds, f"null or an integer >= seeds={self.seeds}")


Builder = Callable[["Study", str, Path, int, Sequence[str]], dict[str, RunConfig]]


@dataclasses.dataclass(frozen=True)
class Study:
    """A named study (``looplm study NAME``). ``measure`` reads one finished run; ``describe``
    gives a row's descriptive cells from its runs (layout, parameters); ``notes`` adds markdown
    after the table; ``build`` replaces the preset-based configuration builder (the ladder's
    rungs are model fields, not presets); ``prepare(run, config)`` runs before a run trains
    (not when a finished run is reused) and writes what its config reads (the ``conversion``
    study's converted start, ``train.init_from``, made from an earlier run); it may return
    the config the run trains with when that depends on an earlier run of the seed (the
    ``distill`` study's hybrid, whose kept-attention blocks its stage-1 run selects).
    ``trainer(run, config, resume, progress)`` builds the Trainer of a run that does not
    train on the next-token loss alone (the ``distill`` study's stages: a loss function and
    callbacks on the Trainer's seams); None from it, or no hook, trains ``Trainer(config)``.
    ``reference``:
    the variant every other row is compared with seed by seed in results.md and paired.csv
    (default: the size's first). ``comparisons``: the (row, reference) pairs compared instead,
    where rows answer different questions (a family with its own baseline); the seed
    extension decides by these pairs."""

    name: str
    title: str
    paper: str
    claim: str
    sizes: Mapping[str, Size]
    metrics: tuple[Metric, ...]
    measure: Callable[[Any], Measures]
    paper_columns: tuple[PaperColumn, ...] = ()
    figures: tuple[Figure, ...] = ()
    deviations: tuple[str, ...] = ()
    describe: Optional[Callable[[str, list], dict[str, str]]] = None
    notes: Optional[Callable[[Any], str]] = None
    build: Optional[Builder] = None
    prepare: Optional[Callable[[str, RunConfig], Optional[RunConfig]]] = None
    trainer: Optional[Callable[[str, RunConfig, bool, bool], Optional["Trainer"]]] = None
    reference: Optional[str] = None
    comparisons: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        rows = {v for size in self.sizes for v in self.variants(size)}
        unknown = [pair for pair in self.comparisons if not set(pair) <= rows or pair[0] == pair[1]]
        if unknown:
            raise ConfigError("study.comparisons", unknown, "(row, reference) pairs of two different rows of "
                              f"study {self.name}: " + ", ".join(sorted(rows)))

    @property
    def primary(self) -> Optional[Metric]:
        """The metric a sweep and the seed extension decide by: the first with a direction."""
        return next((m for m in self.metrics if m.better is not None), None)

    def size(self, name: str) -> Size:
        if name not in self.sizes:
            raise ConfigError("size", name, "one of " + ", ".join(self.sizes) + f" (sizes of study {self.name})")
        return self.sizes[name]

    def variants(self, size: str) -> list[str]:
        """The table's rows, in order."""
        return list(dict.fromkeys(variant_of(run) for run in self.size(size).runs))

    def configs(self, size: str, out_dir: Path, seed: int, overrides: Sequence[str] = ()) -> dict[str, RunConfig]:
        """The RunConfig of every run at ``seed``, validated; each trains in ``out_dir/RUN/seed-SEED``."""
        check_run_names(self.size(size).runs)
        if self.build is not None:
            return self.build(self, size, Path(out_dir), seed, overrides)
        return preset_configs(self.size(size), Path(out_dir), seed, overrides)


def variant_of(run: str) -> str:
    return run.split("/", 1)[0]


def run_dir(out_dir: Path, run: str, seed: int) -> Path:
    return Path(out_dir) / run / f"seed-{seed}"


#: run names are directory names: ``variant`` or ``variant/part`` of these characters (``@``
#: marks a setting of a variant: the ladder's ``ut_act@bias-3``)
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+@-]*(/[A-Za-z0-9][A-Za-z0-9_.+@-]*)?$")


def check_run_names(names) -> None:
    for name in names:
        if not RUN_NAME.match(name):
            raise ConfigError("run", name, "a directory name of letters, digits and _ . + - @, optionally "
                              "variant/part")


#: fields a study sets for every run: the seeds come from --seeds, the directories from --out
STUDY_OWNED = ("train.out_dir", "train.seed", "data.seed")


def check_overrides(overrides: Sequence[str], owned: Sequence[str]) -> list[tuple[str, Any]]:
    """Parse ``key=value`` overrides, refusing keys the study sets (or a field inside or above one)."""
    pairs = parse_overrides(overrides)
    for key, value in pairs:
        for field in (*STUDY_OWNED, *owned):
            if key == field or key.startswith(field + ".") or field.startswith(key + "."):
                why = ("set by the study (--seeds, --out)" if field in STUDY_OWNED
                       else "set by the study's variants; overriding it would change what the table compares")
                raise ConfigError(key, value, f"not overridden in a study: {field} is {why}")
    return pairs


def varied_keys(size: Size) -> list[str]:
    """The fields the runs of a size set to different values (what the table compares)."""
    values: dict[str, set[str]] = {}
    for spec in size.runs.values():
        for key, value in parse_overrides(spec.overrides):
            values.setdefault(key, set()).add(repr(value))
    return sorted(k for k, v in values.items() if len(v) > 1 or
                  sum(1 for spec in size.runs.values() if any(o.startswith(k + "=") for o in spec.overrides))
                  < len(size.runs))


def preset_configs(size: Size, out_dir: Path, seed: int, overrides: Sequence[str] = ()) -> dict[str, RunConfig]:
    """Layers, last wins: the run's preset; the size's shared overrides; the run's overrides;
    ``train.seed`` = ``data.seed`` = seed (init, training stream, evaluation problems); the
    user's overrides (not of a field any run sets); ``train.out_dir``."""
    user = check_overrides(overrides, varied_keys(size))
    configs = {}
    for run, spec in size.runs.items():
        data = read_config_source(spec.preset)
        pairs = parse_overrides([*size.shared, *spec.overrides, f"train.seed={seed}", f"data.seed={seed}"])
        for key, value in [*pairs, *user]:
            set_dotted(data, key, value)
        data.setdefault("train", {})["out_dir"] = str(run_dir(out_dir, run, seed))
        configs[run] = RunConfig.from_dict(data)
    return configs
