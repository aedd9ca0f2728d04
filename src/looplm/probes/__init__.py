"""Analysis probes: what loops do, measured as the papers measure it.

Each probe runs a trained model on held-out data, reading the model's own outputs (loop
states, topology record, attention probabilities; one forward per batch) and, where the
output does not carry something, forward hooks on the model's modules
(:mod:`looplm.probes.capture`). It writes ``NAME.json`` (its numbers) and ``NAME.png`` / ``NAME_*.png``
(figures like the paper's). ``looplm probe RUN --probe NAME`` and :func:`run_probes` run them;
:data:`PROBES` lists them (docs/probes.md describes each).

| name | paper |
| --- | --- |
| update_magnitude, cka, spectrum, shared_subspace, routers | MeSH §2, §4.1, App. E.8, F |
| attention_shift | SpiralFormer §4, App. I |
| head_entropy, entropy_dynamics, attention_contribution | SGT §2-3, §5.4 |
| unrolled_diagnostics | LT2 §4.4 |
| logit_lens | cross-loop logit lens |
| halting | autoregressive-TRM App. B.1, LT2 App. ACT |
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from looplm.probes.base import PROBES, Probe, ProbeError, ProbeInput, ProbeReport, get_probe, register
from looplm.probes.capture import BlockCall, Capture, capture_forward, read_out
# importing the families registers their probes, in this (the listing's) order
from looplm.probes import mesh, attention, residual, lens, halting  # noqa: F401

log = logging.getLogger("looplm")


def _data_config(config, data: Sequence[str], batches: int):
    """The run's data config with ``key=value`` overrides (``data.`` prefix optional; a bare
    PATH means ``source=PATH``) and enough validation batches."""
    from looplm.config import parse_overrides
    from looplm.config_base import set_dotted

    items = []
    for item in data:
        key, sep, value = item.partition("=")
        if not sep:
            key, value = "source", item
        items.append(f"{key if key.startswith('data.') else 'data.' + key}={value}")
    fields = config.data.to_dict()
    for key, value in parse_overrides(items):  # values read as YAML, as on the train command line
        set_dotted({"data": fields}, key, value)
    fields["val_batches"] = batches
    return type(config.data).from_dict(fields, prefix="data")


def load_probe_input(
    path: Union[str, Path], data: Sequence[str] = (), samples: int = 64, batch_size: int = 8, device: str = "cpu",
    verify: bool = True,
) -> ProbeInput:
    """A run's model (verified against its manifest unless ``verify=False``) and
    ``samples`` held-out sequences (the first ones, always the same)."""
    from looplm.data import data_tokenizer, validation_batches
    from looplm.eval.load import load_run

    if samples < 1:
        raise ProbeError(f"samples={samples}; expected an integer >= 1")
    run = load_run(path, device=device, verify=verify)
    data_cfg = _data_config(run.config, data, math.ceil(samples / batch_size))
    tokenizer = data_tokenizer(data_cfg)
    batches, left = [], samples
    for inputs, targets in validation_batches(data_cfg, tokenizer, batch_size):
        if left <= 0:
            break
        batches.append((inputs[:left].to(device), targets[:left].to(device)))
        left -= batches[-1][0].shape[0]
    if not batches:
        raise ProbeError("the validation split is empty: set data.val_fraction > 0 or use more data")
    return ProbeInput(run.model, run.config, Path(path), batches, tokenizer, verify)


def write_report(probe: Probe, report: ProbeReport, out_dir: Path, figures: bool, meta: dict[str, Any]) -> list[Path]:
    """Write ``NAME.json`` and, with ``figures``, ``NAME.png`` / ``NAME_FIGURE.png``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{probe.name}.json"
    payload = {"probe": probe.name, "source": probe.source, **meta, "results": report.numbers}
    path.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    written = [path]
    if figures:
        from looplm.probes.plots import pyplot

        plt = pyplot()
        for name, draw in report.figures.items():
            fig = draw(plt)
            png = out_dir / (f"{probe.name}.png" if name == probe.name else f"{probe.name}_{name}.png")
            fig.savefig(png, dpi=120, bbox_inches="tight")
            plt.close(fig)
            written.append(png)
    return written


def run_probes(
    path: Union[str, Path],
    names: Sequence[str] = ("all",),
    *,
    data: Sequence[str] = (),
    samples: int = 64,
    batch_size: int = 8,
    out_dir: Optional[Union[str, Path]] = None,
    figures: bool = True,
    device: str = "cpu",
    verify: bool = True,
) -> dict[str, dict[str, Any]]:
    """Run probes on a run, checkpoint or save_pretrained directory and write their files
    into ``out_dir`` (default ``PATH/probes``). ``names``: probe names or ``"all"`` (every
    probe that applies to the model; the others are skipped with a log line). Returns
    ``{name: numbers}``."""
    everything = "all" in names
    selected = list(PROBES) if everything else list(dict.fromkeys(names))
    probes = [get_probe(n) for n in selected]
    inputs = load_probe_input(path, data, samples, batch_size, device, verify)
    if figures:
        from looplm.probes.plots import pyplot

        pyplot()  # fail before the work when matplotlib is missing
    out = Path(out_dir) if out_dir is not None else Path(path) / "probes"
    meta = {"checkpoint": str(path), "samples": inputs.samples, "seq_len": int(inputs.batches[0][0].shape[1])}
    results = {}
    for i, probe in enumerate(probes, start=1):
        log.info("probe %s (%d/%d) on %d sequences ...", probe.name, i, len(probes), inputs.samples)
        try:
            report = probe.run(inputs)
        except ProbeError as err:
            if not everything:
                raise
            log.info("probe %s skipped: %s", probe.name, err)
            continue
        files = write_report(probe, report, out, figures, meta)
        log.info("probe %s: %s", probe.name, ", ".join(str(f) for f in files))
        results[probe.name] = report.numbers
    return results


__all__ = [
    "PROBES",
    "BlockCall",
    "Capture",
    "Probe",
    "ProbeError",
    "ProbeInput",
    "ProbeReport",
    "capture_forward",
    "get_probe",
    "load_probe_input",
    "read_out",
    "register",
    "run_probes",
    "write_report",
]
