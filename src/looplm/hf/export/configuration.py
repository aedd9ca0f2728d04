"""The transformers config of a looplm model: looplm's own model config nested whole."""

from __future__ import annotations

from typing import Any, Optional

from transformers import PretrainedConfig

from looplm.config_base import ConfigError
from looplm.model_config import ModelConfig

MODEL_TYPE = "looplm"


class LoopLMConfig(PretrainedConfig):
    """``looplm``: :meth:`ModelConfig.to_dict` of the model (every axis: layout, topology,
    mixers, hybrids, resolution, head loop, streams, halting). ``iterations``: the loop count
    T every forward runs at (test-time compute; None: the trained count), validated by the
    model on first use. The usual transformers fields (``vocab_size``, ``hidden_size``,
    ``tie_word_embeddings``, ...) are derived from ``looplm``; ``use_cache``: whether a
    forward returns its :class:`~looplm.hf.LoopLMCache` by default."""

    model_type = MODEL_TYPE
    looplm: Optional[dict[str, Any]] = None
    iterations: Optional[int] = None
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        if self.looplm is not None:
            cfg = self.model_config()
            self.vocab_size, self.hidden_size = cfg.vocab_size, cfg.d_model
            self.num_attention_heads, self.max_position_embeddings = cfg.n_heads, cfg.max_seq_len
            self.num_hidden_layers = cfg.block_passes  # the unrolled depth
            self.tie_word_embeddings = cfg.tie_embeddings
        if self.iterations is not None and (isinstance(self.iterations, bool) or not isinstance(self.iterations, int)
                                            or self.iterations < 1):
            raise ConfigError("iterations", self.iterations, "None (the trained count) or an integer >= 1")
        super().__post_init__(**kwargs)

    def model_config(self) -> ModelConfig:
        """The looplm :class:`ModelConfig` (validated; a ConfigError names a bad field)."""
        if self.looplm is None:
            raise ConfigError("looplm", None, "looplm's model config (ModelConfig.to_dict()), e.g. from looplm.hf.export")
        return ModelConfig.from_dict(self.looplm, prefix="looplm")
