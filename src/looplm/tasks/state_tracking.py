"""State-based recall (LT2 §4.6, after Olmo-hybrid): pointer swaps over a bit array.

Each example is a short Python-like program, exactly LT2's listing:

    bits = [1,0,1,1,0,0,1,0]
    a, b, c, d, e = 3, 7, 0, 5, 1
    a, c = c, a;
    assert bits[a] == 1
    b, d = d, b;
    assert bits[a] == 1
    ...

"a bit array ``bits`` of length m is written, five variables a–e are bound to five
distinct indices in [0, m), then n swap lines are emitted with an ``assert bits[a] == ?``
after every swap. The model is supervised on each ``?`` token." Here ``?`` is the true
bit ``bits[a]`` after the swap, and only those n answer tokens carry a loss (not the
program text, not ``<eos>``). Swapped pairs are two distinct pointers, written in
alphabetical order (``a, c = c, a;``) as in the listing; every assertion queries ``a``,
as the paper writes it. The program ends with ``<eos>``. Tokens: :class:`ProgramTokenizer`.

Curriculum: n = m grows along ``{8, 16, 32, 64, 128, 256}``; "a model advances once eval
accuracy reaches 0.90"; the headline metric n_max is the largest n = m passed.
"""

from __future__ import annotations

import random
from typing import Any, Optional, Sequence

from looplm.tasks.tokenizers import POINTERS, ProgramTokenizer


def program_tokens(m: int, n: int) -> int:
    """Tokens of a program with ``m`` bits and ``n`` swaps, ``<eos>`` included:
    bits line 2m + 4, pointer line 20, each swap line 9 and assertion line 8, eos 1."""
    return 2 * m + 4 + 20 + 17 * n + 1


def make_program(m: int, n: int, rng: random.Random) -> tuple[list[str], list[int]]:
    """The words of one program (``m`` bits, ``n`` swaps) and the positions of its ``n``
    answer words (the supervised ``?`` tokens) in that list."""
    if m < len(POINTERS):
        raise ValueError(f"m={m} bits cannot hold {len(POINTERS)} distinct pointers")
    bits = [rng.randrange(2) for _ in range(m)]
    pointers = dict(zip(POINTERS, rng.sample(range(m), len(POINTERS))))
    words = ["bits", "=", "["]
    for i, bit in enumerate(bits):
        words += [",", str(bit)] if i else [str(bit)]
    words += ["]", "\n"]
    for i, name in enumerate(POINTERS):
        words += [",", name] if i else [name]
    words.append("=")
    for i, name in enumerate(POINTERS):
        words += [",", str(pointers[name])] if i else [str(pointers[name])]
    words.append("\n")
    answers = []
    for _ in range(n):
        x, y = sorted(rng.sample(POINTERS, 2))
        pointers[x], pointers[y] = pointers[y], pointers[x]
        words += [x, ",", y, "=", y, ",", x, ";", "\n"]
        words += ["assert", "bits", "[", "a", "]", "=="]
        answers.append(len(words))
        words += [str(bits[pointers["a"]]), "\n"]
    words.append("<eos>")
    return words, answers


def encode_program(words: Sequence[str], answers: Sequence[int], tokenizer: ProgramTokenizer
                   ) -> tuple[list[int], list[bool]]:
    """Token ids of a program and, per token, whether it is a training target."""
    ids = [tokenizer.id_of(w) for w in words]
    supervised = [False] * len(ids)
    for i in answers:
        supervised[i] = True
    return ids, supervised


class Curriculum:
    """Stages n = m of ``stages``; :meth:`update` passes the current stage when the
    evaluation accuracy reaches ``threshold`` and moves to the next one (the last stage,
    once passed, stays current). ``n_max`` is the largest n = m passed (None: none yet)."""

    def __init__(self, stages: Sequence[int], threshold: float):
        self.stages, self.threshold = tuple(int(s) for s in stages), float(threshold)
        self.stage = 0
        self.n_max: Optional[int] = None
        self.passed: list[list[int]] = []  # [n = m, step] per stage passed

    @property
    def current(self) -> int:
        """n = m of the stage being trained."""
        return self.stages[self.stage]

    @property
    def finished(self) -> bool:
        return self.n_max == self.stages[-1]

    def update(self, accuracy: float, step: int) -> bool:
        """Record an evaluation of the current stage; True when it passed the threshold."""
        if self.finished or not accuracy >= self.threshold:
            return False
        self.n_max = self.current
        self.passed.append([self.current, int(step)])
        self.stage = min(self.stage + 1, len(self.stages) - 1)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"stages": list(self.stages), "stage": self.stage, "n_max": self.n_max,
                "passed": [list(p) for p in self.passed]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if tuple(state["stages"]) != self.stages:
            raise ValueError(
                f"cannot resume: the saved curriculum is {list(state['stages'])}, this run's "
                f"data.task.curriculum is {list(self.stages)}"
            )
        self.stage, self.n_max = int(state["stage"]), state["n_max"]
        self.passed = [list(p) for p in state["passed"]]
