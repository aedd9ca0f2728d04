"""The mixer kinds: ``kind`` -> config class (which builds the layer). One line per kind."""

from __future__ import annotations

from looplm.mixers.config import AttentionConfig, MixerConfig, SlidingWindowConfig

MIXER_CONFIGS: dict[str, type[MixerConfig]] = {
    "attention": AttentionConfig,
    "sliding_window": SlidingWindowConfig,
}
