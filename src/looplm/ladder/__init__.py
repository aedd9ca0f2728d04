"""The compute-placement ladder: rung configurations at a block-pass budget (``rungs``) and
the ladder as a study of :mod:`looplm.study` (``looplm ladder``, ``looplm study ladder``)."""

from looplm.ladder.rungs import MECHANISMS, RUNGS, passes_per_step, rung_model
from looplm.ladder.runner import QUICK_OVERRIDES, ladder_configs, run_ladder

__all__ = [
    "MECHANISMS",
    "QUICK_OVERRIDES",
    "RUNGS",
    "ladder_configs",
    "passes_per_step",
    "rung_model",
    "run_ladder",
]
