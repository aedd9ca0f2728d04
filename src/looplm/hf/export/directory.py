"""``looplm export RUN OUT``: a directory transformers loads as it is.

OUT holds ``config.json`` (``model_type: "looplm"``, an ``auto_map``, looplm's model config
nested under ``looplm`` and the loop count ``iterations``), ``model.safetensors``,
``generation_config.json``, the tokenizer files, and ``modeling_looplm.py``, the code
``trust_remote_code=True`` runs: two subclasses of this package's classes, so looplm must be
installed where OUT is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from looplm.config_base import ConfigError
from looplm.data import build_tokenizer, data_tokenizer
from looplm.eval.load import load_run
from looplm.hf.export.configuration import LoopLMConfig
from looplm.hf.export.modeling import LoopLMForCausalLM
from looplm.hf.export.tokenizer import transformers_tokenizer

REMOTE_MODULE = "modeling_looplm"
AUTO_MAP = {
    "AutoConfig": f"{REMOTE_MODULE}.LoopLMConfig",
    "AutoModelForCausalLM": f"{REMOTE_MODULE}.LoopLMForCausalLM",
}
# Subclasses, not re-exports: transformers marks the classes it loads as remote code and
# copies their file on save_pretrained, which must be this file, not looplm's own.
REMOTE_CODE = '''"""looplm for transformers' trust_remote_code: needs `pip install looplm[hf]`."""

from looplm.hf.export import LoopLMConfig as _LoopLMConfig
from looplm.hf.export import LoopLMForCausalLM as _LoopLMForCausalLM


class LoopLMConfig(_LoopLMConfig):
    pass


class LoopLMForCausalLM(_LoopLMForCausalLM):
    config_class = LoopLMConfig
'''


def export(run: Union[str, Path], out: Union[str, Path], iterations: Optional[int] = None,
           tokenizer: Optional[str] = None, verify: bool = True) -> Path:
    """Write OUT from a run directory, checkpoint or ``save_pretrained`` directory (verified
    against its manifest unless ``verify=False``). ``iterations``: the loop count the
    exported model runs at (None: the trained count). ``tokenizer``: ``"byte"``, a
    tokenizer.json or a transformers tokenizer directory (None: the run's ``data.tokenizer``;
    a ``save_pretrained`` directory records none, so it gets ``"byte"``). Returns OUT."""
    loaded = load_run(run, verify=verify)
    source = data_tokenizer(loaded.config.data) if tokenizer is None else build_tokenizer(tokenizer)
    hf_tokenizer = transformers_tokenizer(source)
    vocab = loaded.config.model.vocab_size
    if len(hf_tokenizer) > vocab:
        raise ConfigError("tokenizer", source.name, f"a tokenizer of at most model.vocab_size={vocab} tokens (it has "
                          f"{len(hf_tokenizer)}): the run's own tokenizer (export(..., tokenizer=...), --tokenizer)")
    config = LoopLMConfig(looplm=loaded.config.model.to_dict(), iterations=iterations,
                          eos_token_id=hf_tokenizer.eos_token_id, pad_token_id=hf_tokenizer.pad_token_id,
                          bos_token_id=hf_tokenizer.bos_token_id, auto_map=dict(AUTO_MAP))
    model = LoopLMForCausalLM(config)
    model.load_looplm(loaded.model)
    model.eval()
    with torch.no_grad():  # refuse a loop count the model cannot run (a ConfigError naming it) before writing
        model(torch.zeros(1, 1, dtype=torch.long), use_cache=False)
    out = Path(out)
    model.save_pretrained(out)
    hf_tokenizer.save_pretrained(out)
    (out / f"{REMOTE_MODULE}.py").write_text(REMOTE_CODE, encoding="utf-8")
    return out
