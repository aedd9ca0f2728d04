"""The compute-placement ladder: rung configurations at a block-pass budget, and the runner
that trains them on a character task and tabulates the results (``looplm ladder``)."""

from looplm.ladder.results import Ladder, LadderRung, results_table
from looplm.ladder.rungs import MECHANISMS, RUNGS, passes_per_step, rung_model
from looplm.ladder.runner import QUICK_OVERRIDES, ladder_configs, run_ladder

__all__ = [
    "MECHANISMS",
    "QUICK_OVERRIDES",
    "RUNGS",
    "Ladder",
    "LadderRung",
    "ladder_configs",
    "passes_per_step",
    "results_table",
    "rung_model",
    "run_ladder",
]
