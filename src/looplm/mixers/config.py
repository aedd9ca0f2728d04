"""Mixer configs: one frozen dataclass per kind, chosen by the ``kind`` key.

``MixerConfig.from_dict({"kind": "sliding_window", "window": 512})`` returns the
``SlidingWindowConfig`` the registry (``looplm.mixers.registry``) names for that kind,
so each kind validates its own fields and unknown keys are errors. ``build(shape)``
makes the layer, sized by the block's :class:`~looplm.modules.shape.BlockShape`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Optional

import torch
from torch import nn

from looplm.config_base import ConfigError, KindConfig, check
from looplm.mixers.attention import SoftmaxAttention
from looplm.modules.shape import BlockShape


_CANONICAL = "model.mixer"  # the field name mixer checks use, rewritten to where a spec sits


def _placed(err: ConfigError, field: str) -> ConfigError:
    """``err`` with its ``model.mixer.*`` field moved to ``field``, where this spec sits
    (``model.hybrid.mixer``, ``model.loop_mixers[2]``)."""
    if err.field.startswith(_CANONICAL + ".") and field != _CANONICAL:
        return ConfigError(field + err.field[len(_CANONICAL):], err.value, err.allowed)
    return err


#: kind -> config class, filled by :mod:`looplm.mixers.registry` (which the package imports,
#: so it is complete once ``looplm.mixers`` is): the kinds live beside their layers and
#: import this base, so the base holds the table and the registry writes it
KINDS: dict[str, type["MixerConfig"]] = {}


@dataclasses.dataclass(frozen=True)
class MixerConfig(KindConfig):
    """Base of every mixer config; ``kind`` selects the subclass (``looplm.mixers.registry``)."""

    kind: str = "attention"

    FIELD = _CANONICAL

    @classmethod
    def kinds(cls) -> dict[str, type[KindConfig]]:
        return KINDS

    @classmethod
    def from_dict(cls, data: Optional[dict[str, Any]], prefix: str = _CANONICAL) -> "MixerConfig":
        try:
            return super().from_dict(data, prefix)
        except ConfigError as err:  # checks name fields model.mixer.*; this spec may sit elsewhere
            raise _placed(err, prefix) from None

    def validate(self, shape: BlockShape, field: str = _CANONICAL) -> None:
        """Check this spec against the block it sits in (head divisibility, rotary width...)
        by building its layer on the meta device, so such errors surface at config load."""
        try:
            with torch.device("meta"):
                self.build(shape)
        except ConfigError as err:
            raise _placed(err, field) from None

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
        super().__post_init__()
        check(self.window >= 1, "model.mixer.window", self.window, "an integer >= 1")
