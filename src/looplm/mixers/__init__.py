"""Token mixers: one interface (``forward(x, ctx, state) -> (out, state)``), one file per kind.

Every kind has a config class (``looplm.mixers.config`` and beside each layer) listed in
``looplm.mixers.registry``; ``spec.build(model_config)`` makes the layer.

| kind | mixer | decoding state |
| --- | --- | --- |
| attention | softmax attention (optional SDPA output gate, LT2 §4.4) | all keys/values |
| sliding_window | softmax attention over the last ``window`` positions | last w - 1 keys/values |
"""

from looplm.mixers.base import MixerContext, MixerState
from looplm.mixers.config import AttentionConfig, MixerConfig, SlidingWindowConfig

__all__ = ["AttentionConfig", "MixerConfig", "MixerContext", "MixerState", "SlidingWindowConfig"]
