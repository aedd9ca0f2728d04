"""Sparse Growing Transformer (sparse-growing-transformer.txt): entropy-guided head looping
grown deep-to-shallow during training.

- :mod:`~looplm.growth.config`: ``model.head_loop`` (:class:`HeadLoopConfig`).
- :mod:`~looplm.growth.entropy`: Eqs. (4)-(5) and the no-grad meter of training forwards.
- :mod:`~looplm.growth.schedule`: the growth operator of §4.2 / Algorithm 1, with fade-out.
- :mod:`~looplm.growth.structure`: a block's grown loop (depth, head weights) and the
  decoding state of its extra passes.
- :mod:`~looplm.growth.training`: the trainer hook (measure, average, decide, apply, log).
"""

from looplm.growth.config import HeadLoopConfig
from looplm.growth.schedule import GrowthSchedule
from looplm.growth.structure import GrownLoop, LoopedState, block_names, grown_structure

__all__ = ["HeadLoopConfig", "GrowthSchedule", "GrownLoop", "LoopedState", "block_names", "grown_structure"]
