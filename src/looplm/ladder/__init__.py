"""The compute-placement ladder: rung configurations at a block-pass budget."""

from looplm.ladder.rungs import MECHANISMS, RUNGS, passes_per_step, rung_model

__all__ = ["MECHANISMS", "RUNGS", "passes_per_step", "rung_model"]
