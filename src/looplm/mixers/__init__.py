"""Token mixers: one interface (``forward(x, ctx, state) -> (out, state)``), one file per kind.

Every kind has a config class (``looplm.mixers.config`` and beside each layer) listed in
``looplm.mixers.registry``; ``spec.build(model_config.block_shape)`` makes the layer.

| kind | mixer | decoding state |
| --- | --- | --- |
| attention | softmax attention (optional SDPA output gate, LT2 §4.4) | all keys/values |
| sliding_window | softmax attention over the last ``window`` positions | last w - 1 keys/values |
| linear_attention | linear attention, S_t = S_{t-1} + k_t v_tᵀ | S [H, K, V] |
| retnet | retention, S_t = γ_h S_{t-1} + k_t v_tᵀ | S [H, K, V] |
| gla | gated linear attention, S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ | S, conv inputs |
| hgrn2 | S_t = Diag(α_t) S_{t-1} + (1 - α_t) v_tᵀ | S, conv inputs |
| mamba2 | S_t = α_t S_{t-1} + B_t x_tᵀ (scalar α_t per head) | S, conv inputs |
| deltanet | S_t = (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ | S, conv inputs |
| gated_deltanet | S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ | S, conv inputs |
| kda | S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ | S, conv inputs |
| nsa | native sparse attention: compressed, selected and window branches | keys/values, compressed blocks |
| dsa | DeepSeek sparse attention: lightning indexer picks top-k keys | keys/values, index keys |

The linear kinds share two op families (``looplm.ops.decay``, ``looplm.ops.delta``), each
with a plain recurrence (``naive.py``), a chunkwise-parallel form for training
(``chunk.py``) and a step form for decoding (``recurrent.py``).
"""

from looplm.mixers import registry  # noqa: F401  (fills MixerConfig's kind table)
from looplm.mixers.base import MixerContext, MixerState
from looplm.mixers.config import AttentionConfig, MixerConfig, SlidingWindowConfig

__all__ = ["AttentionConfig", "MixerConfig", "MixerContext", "MixerState", "SlidingWindowConfig"]
