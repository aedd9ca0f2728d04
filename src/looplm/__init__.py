"""looplm: looped (recursive, weight-shared-depth) language models in PyTorch.

    from looplm import load_config, Trainer, LoopLM, evaluate_run
    cfg = load_config("tiny-mesh", ["train.max_steps=100"])   # preset or YAML + overrides
    Trainer(cfg).fit()                                         # train; returns the summary
    evaluate_run(cfg.train.out_dir)                            # validation loss / perplexity
"""

from looplm.cache import LoopCache
from looplm.config import RunConfig, load_config
from looplm.config_base import ConfigError
from looplm.eval.load import load_run
from looplm.eval.validation import evaluate_run
from looplm.layout import Layout, parse_layout
from looplm.model import LoopLM, ModelOutput
from looplm.model_config import ModelConfig, TopologyConfig
from looplm.train import Trainer

__all__ = [
    "ConfigError",
    "Layout",
    "LoopCache",
    "LoopLM",
    "ModelConfig",
    "ModelOutput",
    "RunConfig",
    "TopologyConfig",
    "Trainer",
    "evaluate_run",
    "load_config",
    "load_run",
    "parse_layout",
]
__version__ = "0.1.0"
