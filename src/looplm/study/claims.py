"""The papers' claims as paired comparisons in the committed study tables, and their verdicts.

A claim names two rows of a study (or two metrics of one row) and the direction its paper
reports; its verdict is read from the ``runs.csv`` of the first of its tables present under
``docs/results`` (the unrepeated-corpus table before the pydoc one; a table whose study is
still training, marked ``INCOMPLETE``, is not read), paired by seed as
results.md pairs rows: *reproduced* when the mean difference goes the paper's way and is at
least two standard deviations of the differences, *reversed* when it goes the other way as
clearly, *not settled* when it is under two standard deviations, *untested at this scale*
where no CPU-sized table can test it, *not run yet* where its table is still to come. README "Reproductions" opens with :func:`claims_markdown`
(``looplm claims --write README.md``) and a test fails when the tables change and the README
does not, so no verdict says more than the numbers behind it.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path
from typing import Optional, Union

from looplm.config_base import ConfigError
from looplm.study.definition import Metric
from looplm.study.results import INCOMPLETE, Paired, _number, mean_std

PathLike = Union[str, Path]

BEGIN, END = "<!-- claims: begin (looplm claims --write README.md) -->", "<!-- claims: end -->"


@dataclasses.dataclass(frozen=True)
class Claim:
    """``variant``'s ``metric`` is ``better`` (lower / higher) than ``reference``'s
    ``reference_metric`` (default the same metric), seed by seed, as ``source`` reports.
    ``tables``: docs/results directories, the first present is read. ``untested``: why no
    table here tests it (then ``tables`` is empty)."""

    paper: str
    text: str
    source: str
    tables: tuple[str, ...] = ()
    variant: str = ""
    reference: str = ""
    metric: str = "val_loss"
    better: str = "lower"
    reference_metric: Optional[str] = None
    percent: bool = False
    untested: Optional[str] = None

    def __post_init__(self):
        if self.better not in ("lower", "higher"):
            raise ConfigError("claim.better", self.better, "lower or higher")
        if bool(self.tables) == (self.untested is not None):
            raise ConfigError("claim.tables", self.tables, "one or more tables, or none with `untested` saying why")


@dataclasses.dataclass(frozen=True)
class Verdict:
    claim: Claim
    table: Optional[str] = None  # the directory read
    paired: Optional[Paired] = None

    @property
    def word(self) -> str:
        if self.claim.untested is not None:
            return "untested at this scale"
        if self.paired is None or not self.paired.differences:
            return "not run yet"
        if self.paired.undecided:
            return "not settled"
        mean = mean_std(self.paired.differences)[0]
        return "reproduced" if (mean < 0) == (self.claim.better == "lower") else "reversed"

    def evidence(self) -> str:
        if self.claim.untested is not None:
            return self.claim.untested
        if self.paired is None:
            return f"no table yet (docs/results/{self.claim.tables[0]})"
        if not self.paired.differences:
            return f"no seed has both rows in {self.table}"
        p, c = self.paired, self.claim
        mean, std = mean_std(p.differences)
        spread = "" if std is None else f" ± {_number(std, p.metric)}"
        unit = " pp" if c.percent else ""
        against = c.reference if c.reference_metric is None else f"{c.reference} {c.reference_metric}"
        return (f"{c.variant} − {against}: {_signed(mean, p.metric)}{spread}{unit}; "
                f"{c.variant} {c.better} in {p.wins} of {len(p.differences)} seeds, "
                f"{'under' if p.undecided else 'over'} 2 sd")


def _signed(value: float, metric: Metric) -> str:
    text = _number(value, metric)
    return "−" + text[1:] if text.startswith("-") else "+" + text


def read_rows(path: PathLike) -> dict[tuple[str, int], dict[str, float]]:
    """runs.csv as (variant, seed) -> its numeric scalars (a row's parts merged, as results.md does)."""
    rows: dict[tuple[str, int], dict[str, float]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            merged = rows.setdefault((r["variant"], int(r["seed"])), {})
            for key, value in r.items():
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    continue
                if math.isfinite(number):
                    merged.setdefault(key, number)
    return rows


def verdict(claim: Claim, results_dir: PathLike) -> Verdict:
    """The claim's pairs in its first table present under ``results_dir``."""
    for table in claim.tables:
        path = Path(results_dir) / table / "runs.csv"
        if not path.is_file() or (path.parent / INCOMPLETE).is_file():  # a table still training is no verdict
            continue
        rows = read_rows(path)
        other = claim.reference_metric or claim.metric
        seeds = sorted(s for (v, s) in rows if v == claim.variant and (claim.reference, s) in rows
                       and claim.metric in rows[v, s] and other in rows[claim.reference, s])
        scale = 100.0 if claim.percent else 1.0
        diffs = [scale * (rows[claim.variant, s][claim.metric] - rows[claim.reference, s][other]) for s in seeds]
        metric = Metric(claim.metric, claim.metric, digits=1 if claim.percent else 4, better=claim.better)
        return Verdict(claim, table, Paired(claim.variant, claim.reference, metric, seeds, diffs))
    return Verdict(claim)


def claims_markdown(results_dir: PathLike, claims: Optional[tuple[Claim, ...]] = None,
                    link_prefix: str = "docs/results") -> str:
    """The verdict table: one row per claim, its words and the numbers behind them."""
    lines = ["| paper | claim (source) | verdict | evidence (mean paired difference ± sd) | table |",
             "| --- | --- | --- | --- | --- |"]
    for claim in CLAIMS if claims is None else claims:
        v = verdict(claim, results_dir)
        table = "–" if v.table is None else f"[{v.table}]({link_prefix}/{v.table}/results.md)"
        lines.append(f"| {claim.paper} | {claim.text} ({claim.source}) | **{v.word}** | {v.evidence()} | {table} |")
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """``text`` with the part between the claims markers replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ConfigError("claims markers", f"{BEGIN} … {END}", "both present, in this order, in the file written")
    return text[:start + len(BEGIN)] + "\n" + block + "\n" + text[end:]


LT2_LOOPING = "lt2.txt long-context evaluation: looping gains 2-4 recall points at matched parameters; here validation loss"

#: The claims the studies test, in the README's order. A table committed as
#: ``docs/results/<study>-stdlib`` (the unrepeated corpus) takes over from the pydoc one.
CLAIMS: tuple[Claim, ...] = (
    Claim("MeSH", "mesh beats plain recursion", "mesh.txt Table 1, §4", ("mesh-stdlib", "mesh"), "mesh", "base"),
    Claim("MeSH", "mesh beats the vanilla model with 50 % more non-embedding parameters", "mesh.txt Table 1, §4",
        ("mesh-stdlib", "mesh"), "mesh", "vanilla"),
    Claim("MeSH", "mesh beats the best fixed scheme (anchor)", "mesh.txt Table 1", ("mesh-stdlib", "mesh"), "mesh",
        "anchor"),
    Claim("MeSH", "residual beats plain recursion", "mesh.txt Table 1, §4", ("mesh-stdlib", "mesh"), "residual", "base"),
    Claim("MeSH", "anchor beats plain recursion", "mesh.txt Table 1, §4", ("mesh-stdlib", "mesh"), "anchor", "base"),
    Claim("MeSH", "anchor* (the raw embedding) beats anchor", "mesh.txt Table 1, 160M: 8.07 vs 8.10 PPL",
        ("mesh-stdlib", "mesh"), "anchor_embedding", "anchor"),
    Claim("MeSH", "mesh's core changes the state more per iteration than plain recursion's", "mesh.txt §4.1, Fig. 3",
        ("mesh-stdlib", "mesh"), "mesh", "base", metric="update_core", better="higher"),
    Claim("MeSH", "mesh's consecutive loop states are less alike (CKA) than plain recursion's", "mesh.txt §4.1, Fig. 4",
        ("mesh-stdlib", "mesh"), "mesh", "base", metric="cka_loop"),
    Claim("SpiralFormer", "SpiralFormer-B beats the full-resolution loop (T = 2) at fewer FLOPs",
        "spiralformer.txt Table 1, 160M: 11.29 vs 11.37 PPL", ("spiralformer-stdlib", "spiralformer"),
        "SpiralFormer-B", "looped-T2"),
    Claim("SpiralFormer", "SpiralFormer-L beats the full-resolution loop (T = 2)",
        "spiralformer.txt Table 1, 160M: 10.94 vs 11.37 PPL", ("spiralformer-stdlib", "spiralformer"),
        "SpiralFormer-L", "looped-T2"),
    Claim("SGT", "SGT K = 1 beats vanilla", "sparse-growing-transformer.txt Table 1, Fig. 4", ("sgt-stdlib", "sgt"),
        "sgt-k1", "vanilla"),
    Claim("SGT", "SGT K = 2 beats vanilla", "sparse-growing-transformer.txt Table 1, Fig. 4", ("sgt-stdlib", "sgt"),
        "sgt-k2", "vanilla"),
    Claim("SGT", "SGT K = 3 beats vanilla", "sparse-growing-transformer.txt Table 1, Fig. 4", ("sgt-stdlib", "sgt"),
        "sgt-k3", "vanilla"),
    Claim("SGT", "SGT K = 3 beats Block Loop", "sparse-growing-transformer.txt Table 1, §5.2", ("sgt-stdlib", "sgt"),
        "sgt-k3", "block-loop"),
    Claim("LT2", "the looped transformer beats its non-looped twin (same parameters)",
        LT2_LOOPING, ("lt2-stdlib", "lt2"), "attention-looped", "attention"),
    Claim("LT2", "looped GDN beats GDN (same parameters)", LT2_LOOPING,
        ("lt2-stdlib", "lt2"), "gdn-looped", "gdn"),
    Claim("LT2", "looped Full+GDN beats Full+GDN (same parameters)", LT2_LOOPING + ", its hybrid rows",
        ("lt2-stdlib", "lt2"), "full+gdn-looped", "full+gdn"),
    Claim("LT2", "the SDPA output gate improves the looped transformer", "lt2.txt §4.4 (output-gate ablation)",
        ("lt2-stdlib", "lt2-gate"), "attention-looped-gated", "attention-looped"),
    Claim("LT2", "the output gate lowers the first-token attention mass (the sink) in the last loop",
        "lt2.txt §4.4, Fig. loop-sink", ("lt2-stdlib", "lt2-gate"), "attention-looped-gated", "attention-looped",
        metric="sink_last"),
    Claim("LT2", "looping raises the state-tracking n_max", "lt2.txt §4.6, Fig. state-recall",
          untested="no variant passes stage 1 (n = m = 5 at 90 %) at d = 64, even at 4000 steps (84–88 %); "
                   "the paper trains d = 256 at batch 32"),
    Claim("MoR", "expert-choice MoR beats the fixed loop that spends the same block passes (T = 2)",
        "Bae et al. 2025 §3", ("depth-stdlib", "depth"), "mor-expert", "fixed-T2"),
    Claim("MoR", "token-choice MoR beats the fixed loop that spends the same block passes (T = 2)",
        "Bae et al. 2025 §3", ("depth-stdlib", "depth"), "mor-token", "fixed-T2"),
    Claim("Huginn", "more test-time iterations lower the loss (4× the trained mean count)", "Geiping et al. 2025 Fig. 7",
        ("depth-stdlib", "depth"), "huginn-r4-k2", "huginn-r4-k2", metric="val_loss_at_max", reference_metric="val_loss"),
    Claim("Relaxed RT", "per-iteration LoRA r4 beats the tied loop", "Bae et al. 2024 §2.3",
        ("sharing-stdlib", "sharing"), "lora-r4", "tied"),
    Claim("Relaxed RT", "per-iteration LoRA r16 beats the tied loop", "Bae et al. 2024 §2.3",
        ("sharing-stdlib", "sharing"), "lora-r16", "tied"),
    Claim("MeSH E.7", "a MoE FFN with shared experts beats the dense tied core at its FLOPs and active parameters",
        "mesh.txt App. E.7", ("sharing-stdlib", "sharing"), "moe-shared", "tied"),
    Claim("Relaxed RT", "LoRA recovers a converted loop's loss (average init)", "Bae et al. 2024 §2.3, §3",
        ("conversion",), "lora-average", "tied-average"),
    Claim("Relaxed RT", "LoRA recovers a converted loop's loss (stepwise init)", "Bae et al. 2024 §2.3, §3",
        ("conversion",), "lora-stepwise", "tied-stepwise"),
    Claim("Relaxed RT", "stepwise init up-trains the tied loop better than average",
          "Bae et al. 2024 §2.2, as recalled (its text is not in this project)", ("conversion",), "tied-stepwise",
          "tied-average"),
    Claim("AR-TRM", "Dense crosses the final-character bottleneck that UT+ACT does not",
        "autoregressive-trm.txt §5, Figs. 3, 5", ("ladder",), "dense", "ut_act", metric="last", better="higher",
        percent=True),
    Claim("AR-TRM", "Dense crosses the final-character bottleneck that the tied (Iterative) rung does not",
        "autoregressive-trm.txt §5.2, Fig. 5", ("ladder",), "dense", "tied", metric="last", better="higher",
        percent=True),
    Claim("AR-TRM", "Dual UT crosses the final-character bottleneck that UT+ACT does not",
        "autoregressive-trm.txt §5.2, Figs. 4, 5", ("ladder",), "dual_ut", "ut_act", metric="last", better="higher",
        percent=True),
    Claim("AR-TRM", "Dual UT crosses the final-character bottleneck that Dual Nested UT does not",
        "autoregressive-trm.txt §5.2, Fig. 5", ("ladder",), "dual_ut", "dual_nested_ut", metric="last",
        better="higher", percent=True),
    Claim("AR-TRM", "Dense beats the autoregressive TRM (near chance) on characters at α = 1",
        "autoregressive-trm.txt §5, Fig. 3", ("ladder",), "dense", "ar_trm", metric="char@1", better="higher",
        percent=True),
    Claim("LT2 §5", "distillation beats the hybrid trained from scratch at the student's budget",
        "lt2.txt §5, Fig. distill", ("distill",), "distill-per-loop", "scratch"),
)
