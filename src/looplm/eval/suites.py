"""The papers' lm-evaluation-harness suites, as data, and their tables.

A suite is the downstream table of one paper: which lm-eval tasks feed which column,
scored by which metric, at which shots, and the average the paper reports (the mean of
the columns in all four papers; checked against their own rows in the tests). Where a
paper leaves a choice open, :attr:`Suite.note` says what looplm does.

``acc`` is the share of items whose correct choice has the highest log-likelihood;
``acc_norm`` divides each log-likelihood by the choice's length in characters first
(lm-eval's length normalisation, which MeSH App. B calls "normalized by the byte length";
the two agree on ASCII text).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a paper's table: the mean of ``metric`` over ``tasks`` (lm-eval task
    or group names), in percent. ``dataset``: the Hugging Face dataset lm-eval reads for
    them, named in the error when it is not available."""

    header: str
    tasks: tuple[str, ...]
    metric: Literal["acc", "acc_norm"]
    dataset: str


@dataclasses.dataclass(frozen=True)
class Suite:
    """A paper's downstream table: its columns, its shot settings (one row each) and
    where in the paper it is."""

    name: str
    source: str
    shots: tuple[int, ...]
    columns: tuple[Column, ...]
    note: str = ""

    @property
    def tasks(self) -> list[str]:
        """Every lm-eval task or group the suite runs, in column order, once."""
        return list(dict.fromkeys(task for column in self.columns for task in column.tasks))


# MeSH App. B "Downstream Task Evaluation" and SpiralFormer App. F: "length-normalized
# accuracy for PIQA, HellaSwag, ARC-E, ARC-C, and SciQ and standard accuracy for Lambada,
# WinoGrande, and cMMLU", 0 and 5 shots, Avg. over the 9 columns.
_PYTHIA_NINE = (
    Column("LD-O", ("lambada_openai",), "acc", "EleutherAI/lambada_openai"),
    Column("LD-S", ("lambada_standard",), "acc", "cimec/lambada"),
    Column("HS", ("hellaswag",), "acc_norm", "Rowan/hellaswag"),
    Column("PQ", ("piqa",), "acc_norm", "baber/piqa"),
    Column("WG", ("winogrande",), "acc", "allenai/winogrande (winogrande_xl)"),
    Column("ARC-E", ("arc_easy",), "acc_norm", "allenai/ai2_arc (ARC-Easy)"),
    Column("ARC-C", ("arc_challenge",), "acc_norm", "allenai/ai2_arc (ARC-Challenge)"),
    Column("SciQ", ("sciq",), "acc_norm", "allenai/sciq"),
    Column("cMMLU", ("mmlu_continuation",), "acc", "cais/mmlu"),
)

_ARITHMETIC = tuple(f"arithmetic_{n}" for n in ("1dc", "2da", "2dm", "2ds", "3da", "3ds", "4da", "4ds", "5da", "5ds"))

SUITES: dict[str, Suite] = {
    "mesh": Suite(
        "mesh", "MeSH (mesh.txt) App. B and Table 2 (Table 1: the Avg. column)", (0, 5), _PYTHIA_NINE,
    ),
    "spiralformer": Suite(
        "spiralformer", "SpiralFormer (spiralformer.txt) App. F and Table 3 (Table 1: the Avg. column)", (0, 5),
        _PYTHIA_NINE[:-1] + (dataclasses.replace(_PYTHIA_NINE[-1], header="MMLU"),),  # Table 3 heads cMMLU "MMLU"
    ),
    "sgt": Suite(
        "sgt", "SGT (sparse-growing-transformer.txt) §5.1 'Evaluation' and Table 1", (0,),
        (
            Column("ARC-E", ("arc_easy",), "acc", "allenai/ai2_arc (ARC-Easy)"),
            Column("WG", ("winogrande",), "acc", "allenai/winogrande (winogrande_xl)"),
            Column("SIQA", ("social_iqa",), "acc", "lighteval/siqa"),
            Column("Hella.", ("hellaswag",), "acc", "Rowan/hellaswag"),
            Column("OBQA", ("openbookqa",), "acc", "allenai/openbookqa (main)"),
            Column("CSQA", ("commonsense_qa",), "acc", "tau/commonsense_qa"),
            Column("BA", _ARITHMETIC, "acc", "EleutherAI/arithmetic"),
            Column("MMLU", ("mmlu_stem", "mmlu_social_sciences", "mmlu_humanities", "mmlu_other"), "acc",
                   "cais/mmlu"),
        ),
        note="The paper says 'accuracy' and names no shot count (its models were evaluated in the OLMo "
        "framework, whose downstream evaluation is zero-shot): plain accuracy at 0 shots. BA (GPT-3's "
        "BasicArithmetic) is the mean of lm-eval's ten arithmetic tasks, MMLU the mean of the four subjects "
        "the paper names. §5.1 also lists SciQ, which Table 1 has no column for.",
    ),
    "lt2": Suite(
        "lt2", "LT2 (lt2.txt) Table 'tab:downstream' (Appendix 'Evaluation': zero-shot, LM-Evaluation-Harness)", (0,),
        (
            Column("ARC-E", ("arc_easy",), "acc", "allenai/ai2_arc (ARC-Easy)"),
            Column("ARC-C", ("arc_challenge",), "acc", "allenai/ai2_arc (ARC-Challenge)"),
            Column("HellaS.", ("hellaswag",), "acc", "Rowan/hellaswag"),
            Column("PIQA", ("piqa",), "acc", "baber/piqa"),
            Column("WG", ("winogrande",), "acc", "allenai/winogrande (winogrande_xl)"),
            Column("OBQA", ("openbookqa",), "acc", "allenai/openbookqa (main)"),
            Column("SciQ", ("sciq",), "acc", "allenai/sciq"),
            Column("BoolQ", ("boolq",), "acc", "aps/super_glue (boolq)"),
        ),
        note="The paper reports 'zero-shot accuracy' and names no length normalisation: plain accuracy. Its "
        "PPL column is FineWeb-Edu validation perplexity (looplm eval --corpus), not an lm-eval task; the "
        "Appendix lists eleven tasks, Table 'tab:downstream' and its Avg. use these eight (Avg. is their mean for "
        "the 1.3B Looped Transformer, 59.27; the 0.6B row's 56.42 is not the mean of its cells, 56.90).",
    ),
}


def suite_names() -> list[str]:
    return list(SUITES)


# ---------------------------------------------------------------- the table
def _metric(results: Mapping[str, Any], task: str, metric: str) -> float:
    """``metric`` of ``task`` (or group) in one lm-eval results dictionary, a fraction."""
    for section in ("results", "groups"):
        entry = results.get(section, {}).get(task)
        if entry is not None and f"{metric},none" in entry:
            return float(entry[f"{metric},none"])
    raise KeyError(f"lm-eval's results hold no {metric} for {task}")


def suite_table(suite: Suite, results: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The paper's table from lm-eval results dictionaries, one per shot count: a row per
    shot count, a column per :class:`Column` (percent), and Avg., the mean of the columns;
    ``tasks`` keeps each task's own metric (a fraction) beneath its column."""
    rows = []
    for shots in suite.shots:
        cells = {c.header: 100.0 * sum(_metric(results[shots], t, c.metric) for t in c.tasks) / len(c.tasks)
                 for c in suite.columns}
        tasks = {t: {c.metric: _metric(results[shots], t, c.metric)} for c in suite.columns for t in c.tasks}
        rows.append({"shots": shots, "columns": cells, "avg": sum(cells.values()) / len(cells), "tasks": tasks})
    return {"suite": suite.name, "source": suite.source, "note": suite.note,
            "metrics": {c.header: {"tasks": list(c.tasks), "metric": c.metric} for c in suite.columns},
            "rows": rows}


def _number(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.2f}"


def markdown(table: Mapping[str, Any]) -> str:
    """The table as the paper lays it out: Shot, the columns, Avg. (percent)."""
    headers = list(table["metrics"])
    lines = [f"{table['suite']}: {table['source']}", "",
             "| Shot | " + " | ".join(headers) + " | Avg. |", "| --- |" + " ---: |" * (len(headers) + 1)]
    for row in table["rows"]:
        cells = [_number(row["columns"][h]) for h in headers] + [_number(row["avg"])]
        lines.append(f"| {row['shots']}-shot | " + " | ".join(cells) + " |")
    metrics = ", ".join(f"{h} {m['metric']}" for h, m in table["metrics"].items())
    lines += ["", f"Metrics: {metrics}." + (f" {table['note']}" if table["note"] else "")]
    return "\n".join(lines) + "\n"


def write_table(table: Mapping[str, Any], path: str | Path) -> tuple[Path, Path]:
    """``path`` (JSON) and the markdown beside it (same name, ``.md``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
    md = path.with_suffix(".md")
    md.write_text(markdown(table), encoding="utf-8")
    return path, md
