"""What the loop iterates: one hidden state, or a solution and a reasoning stream."""

from __future__ import annotations

import dataclasses
from typing import Literal

from looplm.config_base import Config, check


@dataclasses.dataclass(frozen=True)
class StreamsConfig(Config):
    """``single``: one state h, updated by the topology (UT: h ← f(h + e_t)).

    ``two``: a fixed input stream X (the loop input), a solution stream Y and a reasoning
    stream Z (autoregressive-trm.txt App. B.1). Each macro step runs ``outer`` = H cycles of
    ``inner`` = L reasoning updates Z ← f(X + Y + Z) and one solution update Y ← f(Y + Z):
    H·(L + 1) block passes. H = L = 1 is the Dual UT (Z' = f(X+Y+Z), Y' = f(Y+Z')); larger
    H or L the Dual Nested UT. ``init``: Y⁰ and Z⁰ are learned vectors (default) or zeros.
    ``no_grad_cycles``: the first H − 1 cycles of each macro step run without gradient
    (the original TRM recipe); false backpropagates through every pass.
    """

    kind: Literal["single", "two"] = "single"
    outer: int = 1
    inner: int = 1
    init: Literal["learned", "zeros"] = "learned"
    no_grad_cycles: bool = False

    def __post_init__(self) -> None:
        check(self.outer >= 1, "model.streams.outer", self.outer, "an integer >= 1 (H outer cycles)")
        check(self.inner >= 1, "model.streams.inner", self.inner, "an integer >= 1 (L reasoning updates)")
        if self.kind == "single":
            for name, default in (("outer", 1), ("inner", 1), ("no_grad_cycles", False)):
                check(getattr(self, name) == default, f"model.streams.{name}", getattr(self, name),
                      f"{default!r} for kind=single (it applies to kind=two)")

    @property
    def passes(self) -> int:
        """Block passes of the core per macro step: 1, or H·(L + 1)."""
        return 1 if self.kind == "single" else self.outer * (self.inner + 1)
