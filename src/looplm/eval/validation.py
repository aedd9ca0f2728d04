"""Held-out loss and perplexity of a run (``looplm eval``): the mean next-token loss on the
validation split of its data."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from looplm.config_base import ConfigError
from looplm.data import data_tokenizer, validation_batches
from looplm.eval.adaptive_exit import ExitSpec, ExitTally, exit_report, with_zero_shot_exit
from looplm.eval.load import eval_data_config, load_run, set_step_embeddings
from looplm.targets import IGNORE_INDEX

log = logging.getLogger("looplm")


@torch.no_grad()
def evaluate_run(
    path: str | Path,
    overrides: Sequence[str] = (),
    batches: Optional[int] = None,
    iterations: Optional[int] = None,
    batch_size: int = 8,
    step_embeddings: bool = True,
    verify: bool = True,
    exits: Sequence[ExitSpec] = (),
) -> dict[str, Any]:
    """Mean next-token loss and perplexity on the held-out split of the run's data
    (``data.key=value`` overrides select other data). A non-finite loss (e.g. a loop run
    far past its trained iterations) is returned as it is, with a warning saying so.

    ``exits``: also evaluate the model with each zero-shot exit
    (:func:`~looplm.eval.adaptive_exit.with_zero_shot_exit`) on the same batches; the result
    then holds the full loop's ``block_passes_per_token`` and ``exits``, one row per exit
    (its loss, the loss paid against the full loop, its realised block passes per token and
    the share of passes saved)."""
    run = load_run(path, verify=verify)
    set_step_embeddings(run.model, step_embeddings)
    exiting = {spec.label: with_zero_shot_exit(run.model, spec) for spec in exits}
    full, tallies = ExitTally(), {label: ExitTally() for label in exiting}
    batches_override = [] if batches is None else [f"data.val_batches={batches}"]
    data_cfg = eval_data_config(run.config.data, [*overrides, *batches_override])
    tokenizer = data_tokenizer(data_cfg)
    total, count = 0.0, 0
    for inputs, targets in validation_batches(data_cfg, tokenizer, batch_size):
        out = run.model(inputs, targets, iterations=iterations)
        n = int((targets != IGNORE_INDEX).sum())
        total, count = total + float(out.lm_loss) * n, count + n
        if exiting:
            full.add(out, targets)
            for label, model in exiting.items():
                tallies[label].add(model(inputs, targets, iterations=iterations), targets)
    if count == 0:
        raise ConfigError("data.val_fraction", data_cfg.val_fraction,
                          f"a fraction that leaves a validation window of data.seq_len + 1 = {data_cfg.seq_len + 1} "
                          f"tokens: the held-out split of {data_cfg.source!r} is empty (raise it, or use more data)")
    loss = total / count
    if not math.isfinite(loss):
        trained = run.config.model.iterations
        ran = trained if iterations is None else iterations
        log.warning("val_loss is %s: the model's outputs are not finite with %d loop iterations (trained with %d)%s",
                    loss, ran, trained, "; the loop state diverges when run this far past its training"
                    if ran > trained else "")
    result = {"checkpoint": str(run.path), "tokens": count, "val_loss": loss,
              "val_ppl": math.exp(loss) if loss < 700 else math.inf}
    if exiting:
        result.update(block_passes_per_token=full.passes_per_token, exits=exit_report(full, tallies))
    return result
