"""Typed, frozen config dataclasses that round-trip to plain dicts (and so to YAML).

Every component config subclasses :class:`Config`. ``from_dict`` checks each key and
value against the dataclass annotations, so an unknown key or a wrong type is refused
at load with the dotted name of the field, the value and what is allowed; semantic
checks live in each config's ``__post_init__`` and raise the same :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import types
import math
from typing import Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

from looplm.errors import LoopLMError


class ConfigError(LoopLMError, ValueError):
    """An invalid configuration value. The message names field, value and what is allowed;
    ``cli_hint``, where given, says the same in command-line terms."""

    def __init__(self, field: str, value: Any, allowed: str, cli_hint: str | None = None):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={value!r} is invalid: {allowed}",
                         None if cli_hint is None else f"{field}={value!r} is invalid: {cli_hint}")


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin in (tuple, list):
        return f"a list of {_describe(get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, Config):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, name: str) -> Any:
    """Return ``value`` converted to annotation ``tp``, or raise ConfigError."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(name, value, _describe(tp))
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        alternatives = [a for a in args if a is not type(None)]
        if len(alternatives) == 1:  # Optional[X]: X's own error is the informative one
            return _coerce(alternatives[0], value, name)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, name)
            except ConfigError:
                continue
        raise ConfigError(name, value, _describe(tp))
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(name, value, _describe(tp))
        (item,) = get_args(tp)[:1]
        items = [_coerce(item, v, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if isinstance(tp, type) and issubclass(tp, Config):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(name, value, _describe(tp))
        return tp.from_dict(value, prefix=name)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(name, value, "true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(name, value, "an integer")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None or not math.isfinite(number):  # .inf / .nan would poison training silently
            raise ConfigError(name, value, "a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(name, value, "a string")
    if tp is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(name, value, "a mapping")
    raise TypeError(f"unsupported config annotation {tp!r} for {name}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Base of all configs: strict ``from_dict``, ``to_dict`` and ``replace``."""

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, prefix: str = "") -> "Config":
        data = {} if data is None else data
        where = prefix or cls.__name__
        if not isinstance(data, dict):
            raise ConfigError(where, data, "a mapping")
        hints = get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
            raise ConfigError(key, data[unknown[0]], f"unknown key; allowed keys: {', '.join(fields)}")
        kwargs = {
            key: _coerce(hints[key], value, f"{prefix}.{key}" if prefix else key)
            for key, value in data.items()
        }
        return cls._with_prefix(prefix, **kwargs)

    @classmethod
    def _with_prefix(cls, prefix: str, **kwargs: Any) -> "Config":
        try:
            return cls(**kwargs)
        except ConfigError as err:
            absolute = err.field.split(".")[0] in ("model", "data", "train")  # checks name full paths
            if prefix and not absolute and not err.field.startswith(prefix + "."):
                raise ConfigError(f"{prefix}.{err.field}", err.value, err.allowed) from None
            raise

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if not f.init:
                continue
            value = getattr(self, f.name)
            if isinstance(value, Config):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = [v.to_dict() if isinstance(v, Config) else v for v in value]
            out[f.name] = value
        return out

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class KindConfig(Config):
    """Base of an axis whose ``kind`` key picks one config class per value (mixers,
    topology, halting, streams).

    The axis's base class names its registry (:meth:`kinds`, kind -> class) and where it
    sits (``FIELD``, e.g. ``model.halting``); ``from_dict`` on it dispatches on ``kind``
    (missing: the base's default kind), so each kind checks only its own fields and a field
    of another kind is refused as an unknown key. Constructing a class under another kind's
    name is refused too.
    """

    kind: str = ""

    #: where configs of this axis sit, for error messages (``model.topology``)
    FIELD: ClassVar[str] = ""
    #: keys the axis's former single flat config wrote for every kind (so checkpoints' and
    #: runs' config.json carry them), with that config's defaults: read back and dropped
    #: when a kind without the field holds exactly that default.
    FLAT_DEFAULTS: ClassVar[dict[str, Any]] = {}

    @classmethod
    def kinds(cls) -> dict[str, type["KindConfig"]]:
        raise NotImplementedError(f"{cls.__name__} names no registry of kinds")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The keys a mapping for this kind may have."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    def __post_init__(self) -> None:
        kinds = self.kinds()
        check(self.kind in kinds, f"{self.FIELD}.kind", self.kind, f"one of {', '.join(kinds)}")
        owner = kinds[self.kind]
        check(owner is type(self), f"{self.FIELD}.kind", self.kind,
              f"{type(self).__name__}'s own kind: kind={self.kind} is built by {owner.__name__} "
              f"(or by from_dict({{'kind': {self.kind!r}, ...}}))")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, prefix: str = "") -> "KindConfig":
        prefix = prefix or cls.FIELD
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(prefix, data, "a mapping with a kind, e.g. {kind: " + cls.default_kind() + "}")
        kinds = cls.kinds()
        kind = data.get("kind", cls.default_kind())
        if kind not in kinds:
            raise ConfigError(f"{prefix}.kind", kind, f"one of {', '.join(kinds)}")
        target = kinds[kind]
        if not issubclass(target, cls):
            raise ConfigError(f"{prefix}.kind", kind, f"a kind of {cls.__name__}")
        data = {key: value for key, value in data.items() if key in target.keys() or not cls._flat_default(key, value)}
        for key, value in data.items():
            if key not in target.keys():
                owners = [name for name, other in kinds.items() if key in other.keys()]
                why = f"; {key} is refused unless kind={' or '.join(owners)}" if owners else ""
                raise ConfigError(f"{prefix}.{key}", value,
                                  f"unknown key for kind={kind}; allowed keys: {', '.join(target.keys())}{why}")
        return Config.from_dict.__func__(target, data, prefix)

    @classmethod
    def default_kind(cls) -> str:
        """The kind a mapping without ``kind`` gets: this class's default."""
        return next(f.default for f in dataclasses.fields(cls) if f.name == "kind")

    @classmethod
    def _flat_default(cls, key: str, value: Any) -> bool:
        if key not in cls.FLAT_DEFAULTS:
            return False
        default = cls.FLAT_DEFAULTS[key]
        return value == default or (isinstance(value, list) and tuple(value) == default)


def check(condition: bool, field: str, value: Any, allowed: str) -> None:
    """Raise ConfigError(field, value, allowed) unless ``condition`` holds."""
    if not condition:
        raise ConfigError(field, value, allowed)


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``data['a']['b'] = value`` for ``dotted == 'a.b'``, creating mappings as needed."""
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(dotted, value, f"{key} is not a mapping, so it has no sub-keys")
        node = child
    node[keys[-1]] = value

