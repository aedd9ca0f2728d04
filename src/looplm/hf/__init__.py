"""looplm and Hugging Face, both directions.

- Import (core install: ``json`` and ``safetensors``, transformers never imported):
  :mod:`~looplm.hf.import_model` reads a GPT-NeoX / LLaMA / Ouro checkpoint as a
  :class:`~looplm.model.LoopLM`; :mod:`~looplm.hf.import_run` writes one as a run directory
  (``looplm import``); :mod:`~looplm.hf.convert` turns a dense one into a loop
  (``looplm convert``).
- Export (the ``hf`` extra, transformers >= 5): :mod:`looplm.hf.export`, a run as a
  directory ``AutoModelForCausalLM`` loads (``looplm export``); importing it registers the
  Auto classes.

``looplm.hf.LoopLMConfig`` / ``LoopLMForCausalLM`` / ``LoopLMCache`` / ``byte_tokenizer``
resolve to the export's on first use: the ``modeling_looplm.py`` of directories exported
before the export had its own subpackage imports them from here.
"""

from __future__ import annotations

from typing import Any

from looplm.hf.import_model import config_from_hf, load_hf_checkpoint, read_safetensors, state_dict_from_hf

_EXPORT_NAMES = ("LoopLMCache", "LoopLMConfig", "LoopLMForCausalLM", "byte_tokenizer")


def __getattr__(name: str) -> Any:
    if name in _EXPORT_NAMES:
        from looplm.hf import export

        return getattr(export, name)
    raise AttributeError(f"module 'looplm.hf' has no attribute {name!r}")


__all__ = ["config_from_hf", "load_hf_checkpoint", "read_safetensors", "state_dict_from_hf"]
