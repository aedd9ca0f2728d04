"""The mixer kinds: ``kind`` -> config class (which builds the layer). One line per kind;
written into :data:`looplm.mixers.config.KINDS`, the table ``MixerConfig`` dispatches on."""

from __future__ import annotations

from looplm.mixers.config import KINDS, AttentionConfig, MixerConfig, SlidingWindowConfig
from looplm.mixers.deltanet import DeltaNetConfig
from looplm.mixers.dsa import DSAConfig
from looplm.mixers.gated_deltanet import GatedDeltaNetConfig
from looplm.mixers.gla import GLAConfig
from looplm.mixers.hgrn2 import HGRN2Config
from looplm.mixers.kda import KDAConfig
from looplm.mixers.linear_attention import LinearAttentionConfig
from looplm.mixers.mamba2 import Mamba2Config
from looplm.mixers.nsa import NSAConfig
from looplm.mixers.retnet import RetNetConfig

MIXER_CONFIGS: dict[str, type[MixerConfig]] = {
    "attention": AttentionConfig,
    "sliding_window": SlidingWindowConfig,
    "deltanet": DeltaNetConfig,
    "gated_deltanet": GatedDeltaNetConfig,
    "kda": KDAConfig,
    "linear_attention": LinearAttentionConfig,
    "retnet": RetNetConfig,
    "gla": GLAConfig,
    "hgrn2": HGRN2Config,
    "mamba2": Mamba2Config,
    "nsa": NSAConfig,
    "dsa": DSAConfig,
}
KINDS.update(MIXER_CONFIGS)
