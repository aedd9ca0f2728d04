"""Loading a trained run for evaluation and generation (``looplm eval`` / ``generate``).

RUN_OR_CHECKPOINT is a run directory (its latest checkpoint), a ``checkpoints/step_N``
directory, or a ``save_pretrained`` directory (``config.json`` + ``model.safetensors``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from looplm.config import RunConfig, parse_overrides
from looplm.config_base import ConfigError, set_dotted
from looplm.data import data_tokenizer, validation_batches
from looplm.model import LoopLM
from looplm.model_config import ModelConfig
from looplm.targets import IGNORE_INDEX


@dataclasses.dataclass
class LoadedRun:
    model: LoopLM
    config: RunConfig
    path: Path


def _checkpoint_dir(path: Path) -> Path:
    latest = path / "checkpoints" / "latest"
    if latest.is_file():
        return path / "checkpoints" / latest.read_text().strip()
    if (path / "latest").is_file():
        return path / (path / "latest").read_text().strip()
    return path


def load_run(path: str | Path, device: str = "cpu") -> LoadedRun:
    """Model (eval mode) and run config of a run, checkpoint or pretrained directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: expected a run directory, a checkpoint or a save_pretrained directory")
    directory = _checkpoint_dir(path)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: {path} is not a run, checkpoint or save_pretrained directory")
    raw = json.loads(config_path.read_text())
    if "model" in raw:
        config = RunConfig.from_dict(raw)
    else:  # a save_pretrained directory holds the model config alone
        config = RunConfig(model=ModelConfig.from_dict(raw, prefix="model"))
    from safetensors.torch import load_model

    model = LoopLM(config.model)
    load_model(model, str(directory / "model.safetensors"), strict=True, device=device)
    return LoadedRun(model=model.to(device).eval(), config=config, path=directory)


def set_step_embeddings(model: LoopLM, enabled: bool) -> None:
    """Switch a model's step embeddings on or off (off: run more loop steps than trained,
    autoregressive-trm.txt App. B.2); refused for a model that has none when turning off."""
    if model.step_embedding is None:
        if not enabled:
            raise ConfigError("step_embeddings", False, "true: this model has none to switch off (model.step_embeddings=false)")
        return
    model.step_embedding.enabled = enabled


@torch.no_grad()
def evaluate_run(
    path: str | Path,
    overrides: Sequence[str] = (),
    batches: Optional[int] = None,
    iterations: Optional[int] = None,
    batch_size: int = 8,
    step_embeddings: bool = True,
) -> dict[str, Any]:
    """Mean next-token loss and perplexity on the held-out split of the run's data
    (``data.key=value`` overrides select other data)."""
    run = load_run(path)
    set_step_embeddings(run.model, step_embeddings)
    data = run.config.data.to_dict()
    for key, value in parse_overrides(overrides):  # values parsed as YAML, as for training
        if not key.startswith("data."):
            raise ValueError(f"override {key}={value!r}: only data.* fields can be changed for evaluation")
        set_dotted({"data": data}, key, value)
    if batches is not None:
        data["val_batches"] = batches
    data_cfg = type(run.config.data).from_dict(data, prefix="data")
    tokenizer = data_tokenizer(data_cfg)
    total, count = 0.0, 0
    for inputs, targets in validation_batches(data_cfg, tokenizer, batch_size):
        out = run.model(inputs, targets, iterations=iterations)
        n = int((targets != IGNORE_INDEX).sum())
        total, count = total + float(out.lm_loss) * n, count + n
    if count == 0:
        raise ValueError("the validation split is empty: set data.val_fraction > 0 or use more data")
    loss = total / count
    return {"checkpoint": str(run.path), "tokens": count, "val_loss": loss, "val_ppl": math.exp(loss)}


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
) -> str:
    """Prompt plus continuation, decoded with the run's tokenizer."""
    run = load_run(path)
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
    )
    return prompt + tokenizer.decode(out.new_tokens[0])
