"""A trained run loaded for evaluation: its model (eval mode) and run config, the data it is
evaluated on, and the step-embedding switch every evaluation offers.

RUN_OR_CHECKPOINT is a run directory (its latest checkpoint), a ``checkpoints/step_N``
directory, or a ``save_pretrained`` directory (``config.json`` + ``model.safetensors``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from looplm.artifacts import MODEL_FILE, load_weights, read_weights_dir
from looplm.config import RunConfig, parse_overrides
from looplm.config_base import ConfigError, set_dotted
from looplm.data import DataConfig
from looplm.model import LoopLM
from looplm.model_config import ModelConfig


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
