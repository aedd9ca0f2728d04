"""A run's whole configuration (model, data, training), presets and command-line overrides.

A CONFIG on the command line is a YAML path or the name of a shipped preset
(``looplm/presets/NAME.yaml``, which may ``extends:`` another); ``key=value`` arguments override dotted fields
(``model.topology.kind=mesh``, ``train.max_steps=100``), values parsed as YAML.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from looplm.config_base import Config, ConfigError, set_dotted
from looplm.data.config import DataConfig
from looplm.model_config import ModelConfig
from looplm.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class RunConfig(Config):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()

    @classmethod
    def from_dict(cls, data: Optional[dict[str, Any]], prefix: str = "") -> "RunConfig":
        data = dict(data or {})
        unknown = sorted(set(data) - {"model", "data", "train"})
        if unknown:
            raise ConfigError(unknown[0], data[unknown[0]], "unknown top-level key; allowed keys: model, data, train")
        return cls(
            model=ModelConfig.from_dict(data.get("model"), prefix="model"),
            data=DataConfig.from_dict(data.get("data"), prefix="data"),
            train=TrainConfig.from_dict(data.get("train"), prefix="train"),
        )


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("looplm.presets").iterdir() if p.name.endswith(".yaml"))


def read_config_source(source: Optional[str], _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The raw mapping of a YAML path or preset name (``None``: the default main job).

    A file may start from another with ``extends: NAME_OR_PATH`` and override parts of it.
    """
    if source is None:
        source = "default"
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or path.is_file():  # a folder named like a preset is not a config
        if not path.is_file():
            raise ConfigError("CONFIG", source, "an existing YAML file or a preset name" + _suggest(source))
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError("CONFIG", source, f"a readable UTF-8 YAML file ({err})") from err
    else:
        preset = resources.files("looplm.presets") / f"{source}.yaml"
        if not preset.is_file():
            hint = (f"; {source} is a directory (to continue a run: looplm train CONFIG train.out_dir={source} --resume)"
                    if path.is_dir() else _suggest(source))
            raise ConfigError("CONFIG", source, "a YAML path or a preset name" + hint)
        text = preset.read_text()
    data = _parse_yaml(text, "CONFIG", str(path) if path.is_file() else source) or {}
    if not isinstance(data, dict):
        raise ConfigError("CONFIG", source, "a YAML mapping with keys model, data, train")
    parent = data.pop("extends", None)
    if parent is not None:
        if len(_seen) > 8 or parent in _seen:
            raise ConfigError("extends", parent, "a preset or YAML path that does not extend itself")
        data = _merge(read_config_source(parent, _seen=(*_seen, source)), data)
    return data


def _suggest(source: str) -> str:
    """The presets closest to a misspelt name, and where to see them all."""
    import difflib

    close = difflib.get_close_matches(Path(source).stem, preset_names(), n=4, cutoff=0.6)
    if close:
        return f"; did you mean {', '.join(close)}? (looplm presets lists them all)"
    return ": " + ", ".join(preset_names())


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``override`` into a copy of ``base`` (mappings merge, the rest replaces)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    pairs = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("override", item, "key=value, e.g. model.layout=4+8R2+4 or train.max_steps=100")
        pairs.append((key.strip(), _parse_yaml(value, key.strip(), item) if value.strip() else None))
    return pairs


def _parse_yaml(text: str, field: str, where: str) -> Any:
    """``yaml.safe_load(text)``, a syntax error being a ConfigError that names ``where`` and the line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem, at = str(err).splitlines()[0], ""
        if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
            problem, mark = err.problem or problem, err.problem_mark
            at = f" at line {mark.line + 1}, column {mark.column + 1}"
        raise ConfigError(field, where, f"valid YAML: {problem}{at}") from None


def load_config(source: Optional[str] = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a preset or YAML file, apply ``key=value`` overrides, validate everything."""
    data = read_config_source(source)
    for key, value in parse_overrides(overrides):
        set_dotted(data, key, value)
    return RunConfig.from_dict(data)
