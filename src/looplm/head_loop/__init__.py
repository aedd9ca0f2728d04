"""Sparse Growing Transformer (sparse-growing-transformer.txt): entropy-guided head looping
grown deep-to-shallow during training.

- :mod:`~looplm.head_loop.config`: ``model.head_loop`` (:class:`HeadLoopConfig`).
- :mod:`~looplm.head_loop.entropy`: Eqs. (4)-(5) and the no-grad meter of training forwards.
- :mod:`~looplm.head_loop.schedule`: the growth operator of §4.2 / Algorithm 1, with fade-out.
- :mod:`~looplm.head_loop.structure`: a block's grown loop (depth, head weights) and the
  decoding state of its extra passes.
- :mod:`~looplm.head_loop.attention`: the head-subset attention of an extra pass (Eq. 6).
- :mod:`~looplm.head_loop.block`: the grown blocks (head passes, Block Loop) the model
  builds in place of plain blocks, and the grown structure of a model.
- :mod:`~looplm.head_loop.training`: the trainer hook (measure, average, decide, apply, log).
"""

from looplm.head_loop.config import HeadLoopConfig
from looplm.head_loop.schedule import GrowthSchedule
from looplm.head_loop.structure import GrownLoop, LoopedState

# the grown blocks (looplm.head_loop.block) build on the model's config: import them from there
__all__ = ["HeadLoopConfig", "GrowthSchedule", "GrownLoop", "LoopedState"]
