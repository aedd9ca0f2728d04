"""Interoperability with other libraries' checkpoints (transformers is never imported here)."""

from looplm.interop.hf import config_from_hf, load_hf_checkpoint, read_safetensors, state_dict_from_hf

__all__ = ["config_from_hf", "load_hf_checkpoint", "read_safetensors", "state_dict_from_hf"]
