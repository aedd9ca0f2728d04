"""Mixer configs: one frozen dataclass per kind, chosen by the ``kind`` key.

``MixerConfig.from_dict({"kind": "sliding_window", "window": 512})`` returns the
``SlidingWindowConfig`` the registry (``looplm.mixers.registry``) names for that kind,
so each kind validates its own fields and unknown keys are errors. ``build(shape)``
makes the layer, sized by the block's :class:`~looplm.modules.shape.BlockShape`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Optional

from torch import nn

from looplm.config_base import Config, ConfigError, check
from looplm.modules.shape import BlockShape


_CANONICAL = "model.mixer"  # the field name mixer checks use, rewritten to where a spec sits


@dataclasses.dataclass(frozen=True)
class MixerConfig(Config):
    """Base of every mixer config; ``kind`` selects the subclass."""

    kind: str = "attention"

    @classmethod
    def from_dict(cls, data: Optional[dict[str, Any]], prefix: str = "model.mixer") -> "MixerConfig":
        from looplm.mixers.registry import MIXER_CONFIGS

        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(prefix, data, "a mapping with a kind, e.g. {kind: attention}")
        kind = data.get("kind", "attention")
        if kind not in MIXER_CONFIGS:
            raise ConfigError(f"{prefix}.kind", kind, f"one of {', '.join(MIXER_CONFIGS)}")
        target = MIXER_CONFIGS[kind]
        if cls is not MixerConfig and not issubclass(target, cls):
            raise ConfigError(f"{prefix}.kind", kind, f"a kind of {cls.__name__}")
        try:
            return Config.from_dict.__func__(target, data, prefix)
        except ConfigError as err:  # checks name fields model.mixer.*; this spec may sit elsewhere
            if err.field.startswith(_CANONICAL + ".") and prefix != _CANONICAL:
                field = prefix + err.field[len(_CANONICAL):]
                raise ConfigError(field, err.value, err.allowed) from None
            raise

    def validate(self, shape: BlockShape, field: str = "model.mixer") -> None:
        """Check this spec against the block it sits in (head divisibility, rotary width...)
        by building its layer on the meta device, so such errors surface at config load."""
        import torch

        try:
            with torch.device("meta"):
                self.build(shape)
        except ConfigError as err:
            if err.field.startswith(_CANONICAL + ".") and field != _CANONICAL:
                raise ConfigError(field + err.field[len(_CANONICAL):], err.value, err.allowed) from None
            raise

    def build(self, shape: BlockShape) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} does not build a layer")

    def parameter_group(self) -> Hashable:
        """Specs with equal groups can share one layer's parameters (a loop-level schedule
        builds one layer per group); by default only identical specs do."""
        return self

    def view(self, owner: nn.Module) -> nn.Module:
        """This spec's behaviour on ``owner``, the layer built for its parameter group."""
        return owner

    @property
    def is_softmax(self) -> bool:
        """Whether the mixer computes softmax attention (SGT head looping, probes)."""
        return False


@dataclasses.dataclass(frozen=True)
class AttentionConfig(MixerConfig):
    """Full causal softmax attention; ``output_gate``: LT2's SDPA output gate (§4.4)."""

    kind: str = "attention"
    output_gate: bool = False

    def build(self, shape: BlockShape) -> nn.Module:
        from looplm.mixers.attention import SoftmaxAttention

        return SoftmaxAttention(shape.d_model, shape.n_heads, shape.kv_heads, shape.bias, self.window, self.output_gate)

    @property
    def window(self) -> Optional[int]:
        return None

    def parameter_group(self) -> Hashable:
        return ("softmax", self.output_gate)  # full and windowed attention share parameters

    def view(self, owner: nn.Module) -> nn.Module:
        return owner.with_window(self.window)

    @property
    def is_softmax(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class SlidingWindowConfig(AttentionConfig):
    """Softmax attention over the last ``window`` positions (itself included)."""

    kind: str = "sliding_window"
    window: int = 512

    def __post_init__(self) -> None:
        check(self.window >= 1, "model.mixer.window", self.window, "an integer >= 1")
