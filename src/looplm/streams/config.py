"""``model.streams``: what the loop iterates, one config class per kind.

``StreamsConfig.from_dict({"kind": "two", "outer": 2})`` returns the ``TwoStreamsConfig``
that :data:`STREAMS_CONFIGS` names, so H and L are refused for a single stream.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from torch import nn

from looplm.config_base import KindConfig, check
from looplm.streams.single import SingleStream
from looplm.streams.two import TwoStream


@dataclasses.dataclass(frozen=True)
class StreamsConfig(KindConfig):
    """The base of every stream layout."""

    kind: str = "single"

    FIELD = "model.streams"
    FLAT_DEFAULTS = {"outer": 1, "inner": 1, "init": "learned", "no_grad_cycles": False}

    #: whether the streams, not the topology, define how a macro step updates the state:
    #: several passes of the one shared core per step, at full resolution, with one mixer.
    defines_update: ClassVar[bool] = False

    @classmethod
    def kinds(cls) -> dict[str, type[KindConfig]]:
        return STREAMS_CONFIGS

    @property
    def passes(self) -> int:
        """Block passes of the core per macro step."""
        return 1

    def build(self, d_model: int) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} builds no streams")

    def parameter_count(self, d_model: int) -> int:
        """Parameters the stream layout adds, from the config alone (the analytic counter)."""
        return 0


@dataclasses.dataclass(frozen=True)
class SingleStreamConfig(StreamsConfig):
    """One state h, updated by the topology (UT: h ← f(h + e_t))."""

    kind: str = "single"

    def build(self, d_model: int) -> nn.Module:
        return SingleStream()


@dataclasses.dataclass(frozen=True)
class TwoStreamsConfig(StreamsConfig):
    """A fixed input stream X (the loop input), a solution stream Y and a reasoning stream
    Z (autoregressive-trm.txt App. B.1). Each macro step runs ``outer`` = H cycles of
    ``inner`` = L reasoning updates Z ← f(X + Y + Z) and one solution update Y ← f(Y + Z):
    H·(L + 1) block passes. H = L = 1 is the Dual UT (Z' = f(X+Y+Z), Y' = f(Y+Z')); larger
    H or L the Dual Nested UT. ``init``: Y⁰ and Z⁰ are learned vectors (default), fixed
    random vectors drawn at initialisation and saved with the model (TRM's buffers), or
    zeros. ``no_grad_cycles``: the first H − 1 cycles of each macro step run without
    gradient (the original TRM recipe); false backpropagates through every pass. With
    H > 1 the only cycle with gradient reads Y and Z from a no-grad cycle, so nothing would
    ever train learned Y⁰, Z⁰: that pair is refused.
    """

    kind: str = "two"
    outer: int = 1
    inner: int = 1
    init: Literal["learned", "random", "zeros"] = "learned"
    no_grad_cycles: bool = False

    defines_update = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.outer >= 1, "model.streams.outer", self.outer, "an integer >= 1 (H outer cycles)")
        check(self.inner >= 1, "model.streams.inner", self.inner, "an integer >= 1 (L reasoning updates)")
        check(not (self.init == "learned" and self.no_grad_cycles and self.outer > 1), "model.streams.init",
              self.init, "'random' or 'zeros' with no_grad_cycles and outer > 1 (the first cycle of every "
              "macro step runs without gradient, so learned Y⁰, Z⁰ would never train)")

    @property
    def passes(self) -> int:
        """H·(L + 1)."""
        return self.outer * (self.inner + 1)

    def build(self, d_model: int) -> nn.Module:
        return TwoStream(d_model, self.outer, self.inner, self.init, self.no_grad_cycles)

    def parameter_count(self, d_model: int) -> int:
        return 2 * d_model if self.init == "learned" else 0  # learned Y⁰ and Z⁰ (the others are buffers)


#: The stream layouts: ``kind`` -> config class. One line per kind.
STREAMS_CONFIGS: dict[str, type[KindConfig]] = {
    "single": SingleStreamConfig,
    "two": TwoStreamsConfig,
}
