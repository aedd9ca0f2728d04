"""A run's continuation of a text prompt (``looplm generate``): the run loaded, the prompt
encoded with its tokenizer, sampled through :meth:`LoopLM.generate`, decoded back to text.

Here rather than in :mod:`looplm.generation`: that module sits below the model (the model
decodes through it), and this one loads a run directory and its tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from looplm.data import data_tokenizer
from looplm.eval.load import load_run, set_step_embeddings


def generate_text(
    path: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    iterations: Optional[int] = None,
    seed: int = 0,
    step_embeddings: bool = True,
    verify: bool = True,
    compile: bool = False,
) -> str:
    """Prompt plus continuation, decoded with the run's tokenizer (``compile``: through the
    captured static-cache step, :func:`looplm.generation.generate`)."""
    run = load_run(path, verify=verify)
    set_step_embeddings(run.model, step_embeddings)
    tokenizer = data_tokenizer(run.config.data)
    ids = tokenizer.encode(prompt)
    out = run.model.generate(
        [ids] if ids else [[tokenizer.eos_id]],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        iterations=iterations,
        stop_tokens=(tokenizer.eos_id,),
        pad_token_id=tokenizer.pad_id,
        generator=torch.Generator().manual_seed(seed),
        compile=compile,
    )
    return prompt + tokenizer.decode(out.new_tokens[0])
