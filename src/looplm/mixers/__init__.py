"""Token mixers: one interface (``forward(x, ctx, state) -> (out, state)``), one file per kind.

| kind | mixer | decoding state |
| --- | --- | --- |
| attention | softmax attention (optional SDPA output gate, LT2 §4.4) | all keys/values |
| sliding_window | softmax attention over the last ``window`` positions | last w - 1 keys/values |
"""

from __future__ import annotations

from torch import nn

from looplm.mixers.attention import KVState, SoftmaxAttention
from looplm.mixers.base import MixerContext, MixerState
from looplm.model_config import MixerConfig, ModelConfig


def build_mixer(cfg: ModelConfig, spec: MixerConfig) -> nn.Module:
    """The mixer ``spec`` describes, shaped by the model's width and heads."""
    window = spec.window if spec.kind == "sliding_window" else None
    return SoftmaxAttention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.bias, window, spec.output_gate)


__all__ = ["KVState", "MixerContext", "MixerState", "SoftmaxAttention", "build_mixer"]
