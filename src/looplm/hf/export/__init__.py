"""Export to Hugging Face ``transformers``: config, model, cache, tokenizer, and
:func:`export`, which writes a run as a directory transformers loads.

Importing this package registers :class:`LoopLMConfig` (``model_type: "looplm"``) and
:class:`LoopLMForCausalLM` with ``AutoConfig`` / ``AutoModelForCausalLM``, so an exported
directory (:func:`export`) loads with ``AutoModelForCausalLM.from_pretrained(OUT)``; without
this import, ``trust_remote_code=True`` loads it through the ``modeling_looplm.py`` it ships.
Needs the ``hf`` extra with transformers >= 5.
"""

from __future__ import annotations

from looplm.errors import MissingExtra

try:
    import transformers
except ImportError as err:  # the core stays importable without transformers
    raise MissingExtra(f"looplm.hf.export needs transformers: pip install 'looplm[hf]' ({err})") from err

if int(transformers.__version__.split(".")[0]) < 5:  # dataclass configs, Cache(layers=...), tested on 5.23
    raise MissingExtra(f"looplm.hf.export needs transformers >= 5 (installed: {transformers.__version__}): "
                       "pip install 'looplm[hf]' 'transformers>=5'")

from transformers import AutoConfig, AutoModelForCausalLM

from looplm.hf.export.cache import LoopLMCache
from looplm.hf.export.configuration import MODEL_TYPE, LoopLMConfig
from looplm.hf.export.directory import export
from looplm.hf.export.modeling import LoopLMForCausalLM
from looplm.hf.export.tokenizer import byte_tokenizer

AutoConfig.register(MODEL_TYPE, LoopLMConfig, exist_ok=True)
AutoModelForCausalLM.register(LoopLMConfig, LoopLMForCausalLM, exist_ok=True)

__all__ = ["LoopLMCache", "LoopLMConfig", "LoopLMForCausalLM", "byte_tokenizer", "export"]
