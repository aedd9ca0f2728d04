"""``model.resolution``: how multi-resolution iterations down- and up-scale, and their
chunk offsets and shifts. The resolutions themselves are written in the layout
(``4+8x{1/8,1/4,1/2,1}+4``); per-iteration lists here are checked against that layout's
T by :class:`~looplm.model_config.ModelConfig`."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from looplm.config_base import Config, check
from looplm.ops.backend import KERNELS


@dataclasses.dataclass(frozen=True)
class ResolutionConfig(Config):
    """down: S↓, ``aggregate`` (self-aggregation, Eq. 17-18, the paper's default) or ``mean``
    (Eq. 16). up: S↑, ``router`` (output-dependent allocation, Eq. 21, default) or
    ``uniform`` (Eq. 20). offsets: ω_t per iteration, null for ⌊g_t/2⌋. shifts: s_t per
    iteration, null for g_t − 1 (single-token overlap); s_t ≥ g_t is the parallel regime.
    kernel: where S↓ and S↑ run (:data:`~looplm.ops.backend.KERNELS`): ``auto`` as one
    Triton kernel forward and one backward each on CUDA (:mod:`looplm.ops.resolution_triton`),
    PyTorch's operators elsewhere; ``torch`` everywhere.
    """

    down: Literal["aggregate", "mean"] = "aggregate"
    up: Literal["router", "uniform"] = "router"
    offsets: Optional[tuple[int, ...]] = None
    shifts: Optional[tuple[int, ...]] = None
    kernel: str = "auto"

    def __post_init__(self) -> None:
        check(self.kernel in KERNELS, "model.resolution.kernel", self.kernel, "one of " + ", ".join(KERNELS))
        for name in ("offsets", "shifts"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
                value = getattr(self, name)
            check(
                value is None or all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value),
                f"model.resolution.{name}",
                None if value is None else list(value),
                "null or a list of integers >= 0, one per loop iteration",
            )

    def validate(self, resolutions, layout: str) -> None:
        """Check the per-iteration lists against the layout's resolutions r_t (g_t = ⌊1/r_t⌋)."""
        chunks = [int(1 // r) for r in resolutions]
        T = len(chunks)
        if self.offsets is not None:
            check(len(self.offsets) == T, "model.resolution.offsets", list(self.offsets),
                  f"one offset per iteration ({T} for layout {layout!r}), or null for ⌊g_t/2⌋")
            for t, (w, g) in enumerate(zip(self.offsets, chunks)):
                check(w < g, f"model.resolution.offsets[{t}]", w,
                      f"an offset in 0 .. g_t − 1 = {g - 1} (chunk size g_t = {g}, Eq. 12)")
        if self.shifts is not None:
            check(len(self.shifts) == T, "model.resolution.shifts", list(self.shifts),
                  f"one shift per iteration ({T} for layout {layout!r}), or null for g_t − 1")
            for t, (s, g) in enumerate(zip(self.shifts, chunks)):
                check(s >= g - 1, f"model.resolution.shifts[{t}]", s,
                      f"a shift >= g_t − 1 = {g - 1}: s_t <= g_t − 2 is not causal (spiralformer Prop. 1); "
                      f"use g_t − 1 (overlap) or >= g_t (parallel)")
