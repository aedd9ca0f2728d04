"""A Hugging Face checkpoint as a looplm run directory (``looplm import HF_DIR OUT``).

Any checkpoint :func:`~looplm.hf.import_model.load_hf_checkpoint` reads (Ouro, GPT-NeoX,
LLaMA) is written in the layout ``looplm train`` writes (:mod:`looplm.train.checkpoint`)::

    OUT/checkpoints/latest
    OUT/checkpoints/step_0000000/{model.safetensors, config.json, trainer.pt, manifest.json}
    OUT/tokenizer/                 # the HF directory's tokenizer files, copied

so that ``looplm eval / generate / export / info / probe OUT`` work on it as on a trained
run. ``config.json`` is a whole run config: the imported model, and ``data.tokenizer`` the
copied tokenizer (its absolute path; pass ``data.tokenizer=...`` if the run moves) with
``data.seq_len`` at most the model's ``max_seq_len``. ``trainer.pt`` records step 0, the
source directory and no optimiser state, so ``looplm train --resume OUT`` is refused;
fine-tune with ``train.init_from=OUT`` instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional, Union

from looplm.config_base import ConfigError

#: Where the copied tokenizer lives inside OUT.
TOKENIZER_DIR = "tokenizer"


def import_checkpoint(hf_dir: Union[str, Path], out: Union[str, Path], tokenizer: Optional[str] = None) -> Path:
    """Write the run directory OUT from the HF checkpoint directory ``hf_dir``; returns the
    checkpoint's step directory. ``tokenizer``: ``"byte"``, a tokenizer.json or a
    transformers tokenizer directory to record instead of the HF directory's own tokenizer
    files (None: those, which must exist). OUT must not hold a run already."""
    from looplm.config import RunConfig
    from looplm.data import DataConfig, build_tokenizer
    from looplm.hf.import_model import load_hf_checkpoint
    from looplm.train.checkpoint import has_checkpoints, save_checkpoint

    hf_dir, out = Path(hf_dir), Path(out)
    if has_checkpoints(out):
        raise ConfigError("out", str(out), "a directory that holds no run yet (it already has checkpoints/)")
    model = load_hf_checkpoint(hf_dir)  # refuses an unsupported checkpoint before anything is written
    model_type = json.loads((hf_dir / "config.json").read_text())["model_type"]
    files = _tokenizer_files(hf_dir) if tokenizer is None else []
    if tokenizer is None and not files:
        raise ConfigError("tokenizer", None, f"a tokenizer to record: {hf_dir} has no tokenizer files (tokenizer.json, "
                          "tokenizer_config.json, ...); pass one (import_checkpoint(..., tokenizer=SPEC), --tokenizer)")
    vocab = model.cfg.vocab_size
    out.mkdir(parents=True, exist_ok=True)
    if files:
        target = out / TOKENIZER_DIR
        target.mkdir(exist_ok=True)
        for file in files:
            shutil.copyfile(file, target / file.name)
        # a transformers directory (with its tokenizer_config.json) or a lone tokenizers JSON
        spec = str((target if (target / "tokenizer_config.json").is_file() else target / "tokenizer.json").resolve())
    else:
        spec = tokenizer
    loaded = build_tokenizer(spec)
    if loaded.vocab_size > vocab:
        raise ConfigError("tokenizer", spec, f"a tokenizer of at most model.vocab_size={vocab} tokens (it has "
                          f"{loaded.vocab_size}): the checkpoint's own")
    data = DataConfig(tokenizer=spec, seq_len=min(DataConfig().seq_len, model.cfg.max_seq_len))
    run = RunConfig(model=model.cfg, data=data)
    return save_checkpoint(out, step=0, model=model, run_config=run,
                           state={"imported_from": str(hf_dir.resolve()), "model_type": model_type})


def _tokenizer_files(hf_dir: Path) -> list[Path]:
    """The tokenizer files of an HF checkpoint directory (tokenizer.json, tokenizer_config.json,
    vocab / merges files, special_tokens_map.json, ...): not its weights or model config."""
    from looplm.data.tokenizer import TOKENIZER_FILES

    return sorted(p for p in hf_dir.iterdir() if p.is_file() and p.name.startswith(TOKENIZER_FILES))
