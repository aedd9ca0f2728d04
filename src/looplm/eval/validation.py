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
) -> dict[str, Any]:
    """Mean next-token loss and perplexity on the held-out split of the run's data
    (``data.key=value`` overrides select other data). A non-finite loss (e.g. a loop run
    far past its trained iterations) is returned as it is, with a warning saying so."""
    run = load_run(path, verify=verify)
    set_step_embeddings(run.model, step_embeddings)
    batches_override = [] if batches is None else [f"data.val_batches={batches}"]
    data_cfg = eval_data_config(run.config.data, [*overrides, *batches_override])
    tokenizer = data_tokenizer(data_cfg)
    total, count = 0.0, 0
    for inputs, targets in validation_batches(data_cfg, tokenizer, batch_size):
        out = run.model(inputs, targets, iterations=iterations)
        n = int((targets != IGNORE_INDEX).sum())
        total, count = total + float(out.lm_loss) * n, count + n
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
    return {"checkpoint": str(run.path), "tokens": count, "val_loss": loss,
            "val_ppl": math.exp(loss) if loss < 700 else math.inf}
