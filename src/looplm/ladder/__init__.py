"""The compute-placement ladder: rung configurations at a block-pass budget (``rungs``) and
each rung's run configuration (``runner``). Running it is the study layer's
(:func:`looplm.study.run_ladder`, ``looplm ladder``, ``looplm study ladder``): the ladder
never imports :mod:`looplm.study`."""

from looplm.ladder.rungs import MECHANISMS, RUNGS, passes_per_step, rung_model
from looplm.ladder.runner import QUICK_OVERRIDES, ladder_configs

__all__ = [
    "MECHANISMS",
    "QUICK_OVERRIDES",
    "RUNGS",
    "ladder_configs",
    "passes_per_step",
    "rung_model",
]
