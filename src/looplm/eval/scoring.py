"""Log-probabilities of token windows: the one primitive behind perplexity and lm-eval.

Both corpus perplexity (:mod:`looplm.eval.perplexity`) and the lm-evaluation-harness model
(:mod:`looplm.eval.lm_eval`) reduce to the same question: given a window of tokens,
what is the model's summed log-probability of its last few tokens, and would greedy
decoding have produced them? Answering it in one place means batching, padding and the
order of evaluation are decided once, and tested once.

Windows are batched longest first (a batch that does not fit in memory fails on the
first batch, not after an hour) and right-padded: a causal model's logits at a real
position never read a later one (invariant 1 of the design), so the padding changes no
number, and every row starts at position 0 as it would alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from looplm.model import LoopLM


@dataclasses.dataclass(frozen=True)
class Window:
    """tokens: the model reads ``tokens[:-1]`` and predicts ``tokens[1:]``; the last
    ``scored`` predictions count (the ones before them are context only)."""

    tokens: Sequence[int]
    scored: int


@dataclasses.dataclass(frozen=True)
class Score:
    """logprob: Σ log p(token | everything before it in the window) over the scored
    tokens, in nats; greedy: every scored token is the argmax of its prediction."""

    logprob: float
    greedy: bool


def _check(window: Window, max_len: int) -> None:
    """Callers build windows from the model's context length, so a bad window is a bug."""
    inputs = len(window.tokens) - 1
    if not 1 <= inputs <= max_len:
        raise ValueError(f"a window reads 1..{max_len} tokens (model.max_seq_len), not {inputs}")
    if not 0 <= window.scored <= inputs:
        raise ValueError(f"a window of {inputs + 1} tokens scores 0..{inputs} of them, not {window.scored}")


@torch.no_grad()
def score_windows(
    model: "LoopLM", windows: Sequence[Window], batch_size: int = 8, iterations: Optional[int] = None
) -> list[Score]:
    """One :class:`Score` per window, in the order given.

    Windows run ``batch_size`` at a time, longest first, right-padded, through one full
    forward each (no cache) with ``iterations`` loop steps. Log-probabilities are taken
    in float32 and only at the scored positions, so memory for the log-softmax is
    [scored, V] per row, not [B, T, V].
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, not {batch_size}")
    for window in windows:
        _check(window, model.cfg.max_seq_len)
    device = next(model.parameters()).device
    order = sorted(range(len(windows)), key=lambda i: len(windows[i].tokens), reverse=True)
    scores: list[Optional[Score]] = [None] * len(windows)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            width = len(windows[rows[0]].tokens) - 1  # longest first: the first row is the widest
            inputs = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T], right-padded with token 0
            for r, i in enumerate(rows):
                tokens = windows[i].tokens
                inputs[r, : len(tokens) - 1] = torch.as_tensor(tokens[:-1], dtype=torch.long)
            logits = model(inputs.to(device), iterations=iterations).logits  # [B, T, V]
            for r, i in enumerate(rows):
                scores[i] = _score_row(logits[r], windows[i])
    finally:
        model.train(was_training)
    return scores  # type: ignore[return-value]  # every slot filled above


def _score_row(logits: torch.Tensor, window: Window) -> Score:
    """logits: [T, V] of one row (T >= len(window.tokens) - 1, padding on the right)."""
    if window.scored == 0:
        return Score(0.0, True)
    end = len(window.tokens) - 1  # last real input position + 1
    targets = torch.as_tensor(window.tokens[end - window.scored + 1 :], dtype=torch.long, device=logits.device)
    picked = logits[end - window.scored : end].float()  # [scored, V]: the predictions of the scored tokens
    logprobs = picked.log_softmax(dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # [scored]
    greedy = bool((picked.argmax(dim=-1) == targets).all())
    return Score(float(logprobs.sum()), greedy)
