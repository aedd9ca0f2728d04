"""Copy, Reverse and Addition: the character-level tasks of autoregressive-TRM (App. B.3–B.4).

One example is one line over the 14-character vocabulary, prompt then answer then newline:

    copy       x|x\\n              x: n random digits (leading zeros allowed)
    reverse    x|reverse(x)\\n
    addition   a+b=c\\n            a, b: n random digits each; c = a + b written with n + 1
                                  digits, most significant first, zero-padded

"n" is the input length (L_train in training, α·L_train in evaluation). The paper fixes
the vocabulary and the tasks but prints no example; these formats are those of the
authors' code (linked from the paper, footnote 3): ``|`` separates input from output,
the sum is zero-padded to n + 1 digits and written most-significant digit first (not
reversed), and the example ends with the newline token. Loss is on the answer and its
newline only ("prompt masking (loss on output tokens only)", App. B.4).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

from looplm.tasks.tokenizers import CharacterTokenizer

DIGITS = "0123456789"
TOKENIZER = CharacterTokenizer()


@dataclasses.dataclass(frozen=True)
class Problem:
    """One character-task problem: ``prompt`` (ends with ``|`` or ``=``) and ``answer``
    (without the terminating newline)."""

    prompt: str
    answer: str

    @property
    def text(self) -> str:
        return self.prompt + self.answer + "\n"


def make_problem(task: str, n: int, rng: random.Random) -> Problem:
    """A random problem of ``task`` with input length ``n`` (digits per operand for addition)."""
    if n < 1:
        raise ValueError(f"input length n={n} must be >= 1")
    if task in ("copy", "reverse"):
        x = "".join(rng.choices(DIGITS, k=n))
        return Problem(prompt=x + "|", answer=x if task == "copy" else x[::-1])
    if task == "addition":
        a, b = "".join(rng.choices(DIGITS, k=n)), "".join(rng.choices(DIGITS, k=n))
        return Problem(prompt=f"{a}+{b}=", answer=str(int(a) + int(b)).zfill(n + 1))
    raise ValueError(f"unknown character task {task!r}: copy, reverse or addition")


def held_out(task: str, problem: Problem, fraction: float) -> bool:
    """Whether ``problem`` belongs to the held-out share of its task's problems: a hash of
    the prompt below ``fraction``. The same on every machine and for every seed, so training
    (which never draws a held-out problem) and evaluation (which draws only held-out ones at
    the training lengths) agree on the split without listing the problem space."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(f"looplm.tasks.heldout:{task}:{problem.prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < fraction


def answer_length(task: str, n: int) -> int:
    """Characters of the answer at input length ``n`` (without the newline)."""
    return n + 1 if task == "addition" else n


def example_tokens(task: str, n: int) -> int:
    """Tokens of a whole example at input length ``n``: prompt, answer, newline."""
    prompt = 2 * n + 2 if task == "addition" else n + 1
    return prompt + answer_length(task, n) + 1


def encode_problem(problem: Problem) -> tuple[list[int], list[bool]]:
    """Token ids of ``problem.text`` and, per token, whether it is a training target
    (the answer and its newline; never the prompt)."""
    ids = TOKENIZER.encode(problem.text)
    n_prompt = len(problem.prompt)
    return ids, [i >= n_prompt for i in range(len(ids))]
