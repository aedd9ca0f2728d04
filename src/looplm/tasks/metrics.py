"""Scores of decoded answers against targets (autoregressive-TRM App. B.3, Figs. 3–5).

For a target answer t of length n and a prediction p (the decoded characters before the
first newline; everything generated when no newline came):

- exact match: p == t (the right characters, then the newline, nothing else);
- character accuracy: position-wise over the target, ``Σ_i [i < len(p) and p[i] == t[i]]
  / n``; a prediction that stops early scores its missing positions as wrong, one that
  runs on is scored on its first n characters (the excess only costs exact match);
- quartile accuracy: the target positions split into four quartiles, position i in
  quartile q when ``⌊q·n/4⌋ <= i < ⌊(q+1)·n/4⌋`` (the boundaries of the authors' code;
  n = 11 → 2, 3, 3, 3 positions), scored as the character accuracy;
- last-character accuracy: the position-wise score of position n - 1 (Fig. 5).

Counts are pooled over samples (micro averages), and are integers, so data-parallel
ranks combine them exactly by summing (:meth:`CharacterScores.as_tensor`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch


def quartile_bounds(n: int) -> list[int]:
    """Start of each quartile and the end: ``[0, ⌊n/4⌋, ⌊n/2⌋, ⌊3n/4⌋, n]``."""
    return [q * n // 4 for q in range(5)]


def _ratio(correct: int, total: int) -> Optional[float]:
    return correct / total if total else None


@dataclasses.dataclass
class CharacterScores:
    """Summed counts of :func:`score`; ``summary()`` turns them into the metrics."""

    samples: int = 0
    exact: int = 0
    chars_correct: int = 0
    chars_total: int = 0
    quartile_correct: list[int] = dataclasses.field(default_factory=lambda: [0] * 4)
    quartile_total: list[int] = dataclasses.field(default_factory=lambda: [0] * 4)
    last_correct: int = 0

    def add(self, prediction: str, target: str) -> None:
        """Score one prediction against its (non-empty) target."""
        n = len(target)
        if n == 0:
            raise ValueError("targets must be non-empty")
        hits = [i < len(prediction) and prediction[i] == target[i] for i in range(n)]
        self.samples += 1
        self.exact += int(prediction == target)
        self.chars_correct += sum(hits)
        self.chars_total += n
        bounds = quartile_bounds(n)
        for q in range(4):
            self.quartile_correct[q] += sum(hits[bounds[q]:bounds[q + 1]])
            self.quartile_total[q] += bounds[q + 1] - bounds[q]
        self.last_correct += int(hits[-1])

    def as_tensor(self) -> torch.Tensor:
        """The counts as one int64 vector (for an all-reduce sum)."""
        return torch.tensor([self.samples, self.exact, self.chars_correct, self.chars_total,
                             *self.quartile_correct, *self.quartile_total, self.last_correct], dtype=torch.long)

    @classmethod
    def from_tensor(cls, counts: torch.Tensor) -> "CharacterScores":
        c = [int(v) for v in counts.tolist()]
        return cls(samples=c[0], exact=c[1], chars_correct=c[2], chars_total=c[3],
                   quartile_correct=c[4:8], quartile_total=c[8:12], last_correct=c[12])

    def summary(self) -> dict[str, Any]:
        """``exact_match, char_acc, quartile_acc (Q1..Q4; None for an empty quartile),
        last_char_acc, samples``; rates are None when nothing was scored."""
        return {
            "exact_match": _ratio(self.exact, self.samples),
            "char_acc": _ratio(self.chars_correct, self.chars_total),
            "quartile_acc": [_ratio(c, t) for c, t in zip(self.quartile_correct, self.quartile_total)],
            "last_char_acc": _ratio(self.last_correct, self.samples),
            "samples": self.samples,
        }


def score(predictions: list[str], targets: list[str]) -> dict[str, Any]:
    """The metrics of paired predictions and targets (see the module docstring)."""
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    scores = CharacterScores()
    for p, t in zip(predictions, targets):
        scores.add(p, t)
    return scores.summary()
