"""looplm: looped (recursive, weight-shared-depth) language models in PyTorch."""

from looplm.cache import LoopCache
from looplm.config_base import ConfigError
from looplm.layout import Layout, parse_layout
from looplm.model import LoopLM, ModelOutput
from looplm.model_config import ModelConfig, TopologyConfig

__all__ = [
    "ConfigError",
    "Layout",
    "LoopCache",
    "LoopLM",
    "ModelConfig",
    "ModelOutput",
    "TopologyConfig",
    "parse_layout",
]
__version__ = "0.1.0"
