"""Which mixer each block runs: depth-level and loop-level hybrids (LT2 §3, Table 4).

* Depth-level (``model.hybrid``): among the distinct block positions of the layout, in
  the order prelude, core, coda, some use ``hybrid.mixer`` instead of ``model.mixer``:
  a ``ratio`` main:hybrid (``"4:1"``: one hybrid block in five, LT2's Full:GDN = 1:4)
  placed by ``interleave`` (every (a+b)/b-th block when that is a whole number, else
  evenly spread), ``bookend`` (half at the bottom, half at the top), ``front`` or
  ``back``; or an explicit list of block indices ``layers``.
* Loop-level (``model.loop_mixers``): one mixer per iteration for the core blocks, e.g.
  Full -> SWA-512 -> SWA-256 -> SWA-128. Iterations whose mixers differ only in their
  window share one set of parameters (the core is weight-shared); different kinds get
  their own parameters, shared by the iterations that use them.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Literal, Optional, Sequence

from looplm.config_base import Config, ConfigError, check
from looplm.mixers.config import AttentionConfig, MixerConfig
from looplm.structure import LoopStructure

PLACEMENTS = ("interleave", "bookend", "front", "back")


@dataclasses.dataclass(frozen=True)
class HybridConfig(Config):
    """Depth-level hybrid: some blocks use ``mixer`` instead of the model's main mixer."""

    mixer: MixerConfig = AttentionConfig()
    ratio: str = "4:1"
    placement: Literal["interleave", "bookend", "front", "back"] = "interleave"
    layers: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if isinstance(self.mixer, dict):
            object.__setattr__(self, "mixer", MixerConfig.from_dict(self.mixer, prefix="model.hybrid.mixer"))
        self.split_ratio()
        check(
            self.layers is None or (len(self.layers) > 0 and all(i >= 0 for i in self.layers)),
            "model.hybrid.layers", self.layers, "null or a non-empty list of block indices >= 0",
        )

    def split_ratio(self) -> tuple[int, int]:
        """(main, hybrid) parts of ``ratio``."""
        try:
            main, hybrid = (int(p) for p in str(self.ratio).split(":"))
        except ValueError:
            raise ConfigError("model.hybrid.ratio", self.ratio, "'a:b' with whole numbers, e.g. '4:1' (main:hybrid)") from None
        check(main >= 0 and hybrid >= 1, "model.hybrid.ratio", self.ratio, "'a:b' with a >= 0 and b >= 1")
        return main, hybrid


def hybrid_positions(hybrid: HybridConfig, n_blocks: int) -> list[int]:
    """Indices (0 .. n_blocks-1, prelude then core then coda) of the blocks using hybrid.mixer."""
    if hybrid.layers is not None:
        bad = [i for i in hybrid.layers if i >= n_blocks]
        if bad:
            raise ConfigError("model.hybrid.layers", list(hybrid.layers), f"indices below {n_blocks}, the number of blocks")
        return sorted(set(hybrid.layers))
    main, other = hybrid.split_ratio()
    share = Fraction(other, main + other)
    count = round(n_blocks * share)
    if count == 0:
        raise ConfigError("model.hybrid.ratio", hybrid.ratio, f"a ratio that gives at least one hybrid block among {n_blocks}")
    if hybrid.placement == "interleave":
        period = Fraction(main + other, other)
        if period.denominator == 1:  # LT2: "every 5th layer is Full" for 1:4
            return [i for i in range(n_blocks) if (i + 1) % int(period) == 0] or [n_blocks - 1]
        return [math.ceil((m + 1) * n_blocks / count) - 1 for m in range(count)]
    if hybrid.placement == "front":
        return list(range(count))
    if hybrid.placement == "back":
        return list(range(n_blocks - count, n_blocks))
    bottom = (count + 1) // 2  # bookend: the odd one out goes to the bottom
    return [*range(bottom), *range(n_blocks - (count - bottom), n_blocks)]


def block_mixers(
    structure: LoopStructure, mixer: MixerConfig, hybrid: Optional[HybridConfig],
    loop_mixers: Optional[Sequence[MixerConfig]],
) -> dict[tuple[str, int], tuple[MixerConfig, ...]]:
    """``(part, j) -> mixers`` for every position of ``structure``: one spec for
    prelude/coda blocks and unscheduled core blocks, one per iteration for core blocks
    under ``loop_mixers``."""
    positions = structure.positions
    chosen = set(hybrid_positions(hybrid, len(positions))) if hybrid is not None else set()
    plan = {}
    for index, (part, j) in enumerate(positions):
        if part == "core" and loop_mixers is not None:
            plan[(part, j)] = tuple(loop_mixers)
        else:
            plan[(part, j)] = (hybrid.mixer if index in chosen else mixer,)
    return plan
