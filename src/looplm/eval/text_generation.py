"""A run's continuation of a text prompt (``looplm generate``): the run loaded, the prompt
encoded with its tokenizer, sampled through :meth:`LoopLM.generate`, decoded back to text.

Here rather than in :mod:`looplm.generation`: that module sits below the model (the model
decodes through it), and this one loads a run directory and its tokenizer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

import torch

from looplm.data import data_tokenizer
from looplm.eval.adaptive_exit import ExitSpec, with_zero_shot_exit
from looplm.eval.load import load_run, set_step_embeddings

log = logging.getLogger("looplm")


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
    compile: Union[bool, str] = False,
    exit: Optional[ExitSpec] = None,
) -> str:
    """Prompt plus continuation, decoded with the run's tokenizer (``compile``: through the
    captured static-cache step, :func:`looplm.generation.generate`). ``exit``: decode with a
    zero-shot adaptive exit (:func:`~looplm.eval.adaptive_exit.with_zero_shot_exit`) and log
    the realised block passes per token against the full loop's."""
    run = load_run(path, verify=verify)
    set_step_embeddings(run.model, step_embeddings)
    model = run.model if exit is None else with_zero_shot_exit(run.model, exit)
    tokenizer = data_tokenizer(run.config.data)
    ids = tokenizer.encode(prompt)
    out = model.generate(
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
    if exit is not None:
        log.info("exit %s: %.2f block passes per token (full loop %d)", exit.label, out.block_passes_per_token,
                 run.config.model.block_passes)
    return prompt + tokenizer.decode(out.new_tokens[0])
