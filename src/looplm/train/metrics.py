"""Run records: the append-only ``metrics.jsonl`` event log and the end-of-run summary.

``metrics.jsonl`` holds one JSON object per line, each with ``event`` and ``step``
(optimiser steps completed) and ``time`` (Unix seconds):

* ``train``: ``loss, lr, grad_norm, tokens, tokens_per_s`` every ``train.log_every`` steps;
* ``eval``: ``val_loss, val_ppl`` (``val_ppl = exp(val_loss)``);
* ``skipped``: a step whose loss or gradient norm was not finite (``loss, grad_norm, bad_steps``);
* ``start`` / ``resume``: where a process began (``resume`` names the checkpoint).

The file is only appended to. After a crash and resume the steps between the checkpoint
and the crash are logged again, after a ``resume`` event; a later record of a step
supersedes an earlier one (:func:`train_losses` applies that rule). Non-finite numbers
are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` so every line is strict JSON.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

if TYPE_CHECKING:
    from looplm.train.trackers import Tracker


def perplexity(loss: float) -> float:
    """``exp(loss)``; ``inf`` when it overflows or the loss is not finite."""
    try:
        return math.exp(loss) if math.isfinite(loss) else math.inf
    except OverflowError:
        return math.inf


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as strings (JSON has no NaN or infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class MetricsWriter:
    """Appends events to ``path`` (``None``: a writer that drops everything, for ranks > 0).

    ``fresh=True`` empties the file first (a new run); otherwise lines are appended (a
    resume). Each event opens, appends and closes the file, so a killed run keeps every
    line it logged and no handle outlives the writer's use (events are at most one per step).
    """

    def __init__(self, path: Optional[Union[str, os.PathLike]], fresh: bool = False,
                 trackers: Sequence["Tracker"] = ()):
        self.path = Path(path) if path is not None else None
        self.trackers = list(trackers)  # TensorBoard, W&B: the same events as scalars (looplm.train.trackers)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if fresh:
                self.path.write_text("", encoding="utf-8")

    def log(self, event: str, step: int, **fields: Any) -> dict[str, Any]:
        """Write ``{"event", "step", **fields, "time"}`` as one line; return the record."""
        record = {"event": event, "step": step, **fields, "time": round(time.time(), 3)}
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(json_safe(record)) + "\n")
        for tracker in self.trackers:
            tracker.log(event, step, fields)
        return record

    def close(self) -> None:
        """Close the trackers (the JSONL file needs nothing)."""
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def read_metrics(path: Union[str, os.PathLike]) -> list[dict[str, Any]]:
    """Every event of a ``metrics.jsonl``, in file order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def session_values(path: Union[str, os.PathLike], key: str) -> list[Any]:
    """``key`` of each training session of a run (its ``start`` and ``resume`` events), in
    order, for the sessions that recorded one; empty without a ``metrics.jsonl``."""
    if not os.path.isfile(path):
        return []
    return [e[key] for e in read_metrics(path) if e["event"] in ("start", "resume") and e.get(key) is not None]


def recorded_data(path: Union[str, os.PathLike]) -> Optional[dict[str, Any]]:
    """The data identity (:func:`looplm.data.identity.data_identity`) the last training session
    of a run recorded, or None (sessions from before runs recorded it, or data looplm cannot
    identify)."""
    sessions = session_values(path, "data")
    return sessions[-1] if sessions else None


def train_losses(path: Union[str, os.PathLike]) -> dict[int, float]:
    """``{step: loss}`` of the ``train`` events, the last record of each step winning."""
    return {e["step"]: e["loss"] for e in read_metrics(path) if e["event"] == "train"}


def _count(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit} ({n:,})"
    return f"{n:,}"


def _number(x: Optional[float], fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def format_summary(summary: dict[str, Any]) -> str:
    """A readable two-column table of the summary dict :class:`~looplm.train.Trainer` returns."""
    params = summary["parameters"]
    tied = " (tied to the embedding)" if params["head"] == 0 and params["embedding"] else ""
    components = [
        (f"  {name}", _count(n) + (tied if name == "head" else ""))
        for name, n in params.items()
        if name not in ("total", "non_embedding")
    ]
    rows = [
        ("run directory", summary["out_dir"]),
        ("parameters", f"{_count(params['total'])} total, {_count(params['non_embedding'])} non-embedding"),
        *components,
        ("unrolled depth", f"{summary['unrolled_depth']} blocks ({summary['layout']})"),
        ("steps", f"{summary['steps']} / {summary['max_steps']}  ({summary['skipped_steps']} skipped)"),
        ("tokens seen", _count(summary["tokens_seen"])),
        ("train loss / ppl", f"{_number(summary['train_loss'])} / {_number(summary['train_ppl'], '.2f')}"),
        ("val loss / ppl", f"{_number(summary['val_loss'])} / {_number(summary['val_ppl'], '.2f')}"),
        ("throughput", f"{_number(summary['tokens_per_s'], ',.0f')} tokens/s"),
        ("wall time", f"{_number(summary['wall_time_s'], '.1f')} s"),
        ("device", f"{summary['device']} ({summary['precision']}, {summary['world_size']} process(es))"),
        ("checkpoint", summary["checkpoint"] or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    rule = "-" * min(max(len(line) for line in lines), 80)
    return "\n".join([rule, *lines, rule])
