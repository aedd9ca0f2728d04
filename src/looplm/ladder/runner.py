"""Run the compute-placement ladder (autoregressive-trm.txt §5, App. B) on one character task.

Every rung starts from the same task preset ``task-<task>`` (width, heads, block template,
optimiser, data stream, evaluation problems and seed all identical) and differs only in the
``model`` fields of :func:`~looplm.ladder.rung_model`, which make each forward spend exactly
``budget`` = C block passes (App. B "Compute normalization"; ACT and Q-halt in full-compute
mode, B.1). The ladder is a study (:func:`looplm.study.ladder_study`, ``looplm study ladder``
for the registered multi-seed one): each rung is an ordinary :class:`~looplm.train.Trainer`
run in ``out_dir/<rung>/seed-<seed>/``, and the study runner writes into ``out_dir``:

- ``results.md``: the command line, the machine, and one row per rung: Table 1's ticks, C,
  parameters, exact match and character accuracy at every α, and the quartile (Fig. 4) and
  last-character (Fig. 5) accuracies at α = 1, and the halting rungs' readout depth (mean ±
  std where several seeds ran);
- ``results.csv`` (per rung × metric), ``runs.csv`` (per rung × seed) and ``series.csv``
  (the curves, per rung × seed × point);
- ``accuracy.png`` (Fig. 6), ``quartiles.png`` (Fig. 4), ``length.png``, ``last_char.png``
  (Fig. 5) and ``halting_weights.png`` (ACT weight per macro step), when matplotlib is
  installed (``pip install 'looplm[plot]'``).

Resuming (:mod:`looplm.study.runs`): rerunning the same ladder finishes what an interrupted
one left. A rung whose directory holds a finished run of the same configuration is read back,
not retrained; a rung stopped midway continues from its latest checkpoint (the Trainer's
exact resume); a directory holding a run of another configuration is refused before anything
trains, so one table never mixes settings.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from looplm.config import RunConfig, parse_overrides, read_config_source
from looplm.config_base import ConfigError, set_dotted
from looplm.halting.config import HaltingConfig
from looplm.ladder.rungs import MECHANISMS, RUNGS, rung_model
from looplm.tasks.config import CHARACTER_TASKS

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
