"""Loading a trained run for evaluation and generation (``looplm eval`` / ``generate``).

RUN_OR_CHECKPOINT is a run directory (its latest checkpoint), a ``checkpoints/step_N``
directory, or a ``save_pretrained`` directory (``config.json`` + ``model.safetensors``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from looplm.artifacts import MODEL_FILE, load_weights, read_weights_dir
from looplm.config import RunConfig, parse_overrides
from looplm.config_base import ConfigError, set_dotted
from looplm.data import DataConfig, data_tokenizer, validation_batches
from looplm.model import LoopLM
from looplm.model_config import ModelConfig
from looplm.targets import IGNORE_INDEX

log = logging.getLogger("looplm")


@dataclasses.dataclass
class LoadedRun:
    model: LoopLM
    config: RunConfig
    path: Path


def load_run(path: str | Path, device: str = "cpu", verify: bool = True) -> LoadedRun:
    """Model (eval mode) and run config of a run, checkpoint or pretrained directory, its
    files verified against their manifest first (``verify=False``: skip that, for forensics
    on a damaged directory)."""
    directory, raw = read_weights_dir(path, verify=verify)
    if "model" in raw:
        config = RunConfig.from_dict(raw)
    else:  # a save_pretrained directory holds the model config alone
        config = RunConfig(model=ModelConfig.from_dict(raw, prefix="model"))
    model = LoopLM(config.model)
    load_weights(model, directory / MODEL_FILE, device=device)
    return LoadedRun(model=model.to(device).eval(), config=config, path=directory)


def set_step_embeddings(model: LoopLM, enabled: bool) -> None:
    """Switch a model's step embeddings on or off (off: run more loop steps than trained,
    autoregressive-trm.txt App. B.2); refused for a model that has none when turning off."""
    if model.step_embedding is None:
        if not enabled:
            raise ConfigError("step_embeddings", False, "true: this model has none to switch off (model.step_embeddings=false)")
        return
    model.step_embedding.enabled = enabled


def eval_data_config(data: DataConfig, overrides: Sequence[str]) -> DataConfig:
    """A run's data config with ``data.key=value`` overrides (values parsed as YAML, as
    for training); any other field is refused: only the data can change for evaluation."""
    fields = data.to_dict()
    for key, value in parse_overrides(overrides):
        if not key.startswith("data."):
            raise ConfigError(key, value, "a data.* field: only the data can be changed for evaluation")
        set_dotted({"data": fields}, key, value)
    return DataConfig.from_dict(fields, prefix="data")


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


def generate_text(
    path: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    iterations: Optional[int] = None,
    seed: int = 0,
    step_embeddings: bool = True,
    verify: bool = True,
    compile: bool = False,
) -> str:
    """Prompt plus continuation, decoded with the run's tokenizer (``compile``: through the
    captured static-cache step, :func:`looplm.generation.generate`)."""
    run = load_run(path, verify=verify)
    set_step_embeddings(run.model, step_embeddings)
    tokenizer = data_tokenizer(run.config.data)
    ids = tokenizer.encode(prompt)
    out = run.model.generate(
        [ids] if ids else [[tokenizer.eos_id]],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        iterations=iterations,
        stop_tokens=(tokenizer.eos_id,),
        pad_token_id=tokenizer.pad_id,
        generator=torch.Generator().manual_seed(seed),
        compile=compile,
    )
    return prompt + tokenizer.decode(out.new_tokens[0])
