"""Task generators: answers checked against Python arithmetic and an independent simulation."""

from __future__ import annotations

import random
import re

import pytest

from looplm.data import Tokenizer
from looplm.tasks import (
    CharacterTokenizer,
    ProgramTokenizer,
    answer_length,
    example_tokens,
    make_problem,
    make_program,
    program_tokens,
)
from looplm.tasks.character import encode_problem
from looplm.tasks.state_tracking import encode_program


def test_character_vocabulary_is_the_papers_14_tokens() -> None:
    tok = CharacterTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 14 and tok.decode(range(14)) == "0123456789|+=\n"
    assert tok.eos_id == tok.pad_id == tok.encode("\n")[0] == 13
    assert tok.decode(tok.encode("0123+99=0222\n")) == "0123+99=0222\n"
    with pytest.raises(ValueError, match="'T' is not in the task vocabulary"):
        tok.encode("The ")


@pytest.mark.parametrize("n", [1, 2, 7, 30])
def test_copy_and_reverse(n) -> None:
    rng = random.Random(n)
    for _ in range(50):
        copy = make_problem("copy", n, rng)
        x = copy.prompt[:-1]
        assert re.fullmatch(rf"\d{{{n}}}\|", copy.prompt) and copy.answer == x
        assert copy.text == f"{x}|{x}\n"
        rev = make_problem("reverse", n, rng)
        assert rev.answer == "".join(reversed(rev.prompt[:-1])) and len(rev.answer) == n
        for p, task in ((copy, "copy"), (rev, "reverse")):
            assert len(p.text) == example_tokens(task, n) and len(p.answer) == answer_length(task, n)


@pytest.mark.parametrize("n", [1, 3, 10, 50])
def test_addition_matches_python_arithmetic(n) -> None:
    rng = random.Random(100 + n)
    carries = 0
    for _ in range(200):
        p = make_problem("addition", n, rng)
        m = re.fullmatch(rf"(\d{{{n}}})\+(\d{{{n}}})=", p.prompt)
        assert m, p.prompt
        a, b = m.groups()
        assert int(p.answer) == int(a) + int(b)  # most significant digit first, not reversed
        assert len(p.answer) == n + 1 == answer_length("addition", n)  # zero-padded to n + 1 digits
        assert len(p.text) == example_tokens("addition", n)
        carries += p.answer[0] == "1"
    assert 0 < carries < 200  # both a final carry and none occur


def test_prompt_masking_of_one_example() -> None:
    p = make_problem("addition", 3, random.Random(0))
    ids, supervised = encode_problem(p)
    assert CharacterTokenizer().decode(ids) == p.text
    assert supervised == [False] * len(p.prompt) + [True] * (len(p.answer) + 1)  # answer and its newline


# ------------------------------------------------------------------ state tracking
def simulate(text: str) -> list[int]:
    """An independent reading of a program's text: parse the bits, the pointers and every
    swap with regular expressions and return bits[a] after each swap."""
    lines = text.splitlines()
    bits = [int(b) for b in re.fullmatch(r"bits = \[([01](?:,[01])*)\]", lines[0]).group(1).split(",")]
    names, values = re.fullmatch(r"([a-e](?:, [a-e])*) = (\d+(?:, \d+)*)", lines[1]).groups()
    ptr = dict(zip(names.split(", "), map(int, values.split(", "))))
    out = []
    for line in lines[2:]:
        swap = re.fullmatch(r"([a-e]), ([a-e]) = \2, \1;", line)
        if swap:
            x, y = swap.groups()
            ptr[x], ptr[y] = ptr[y], ptr[x]
        else:
            assert re.fullmatch(r"assert bits\[a\] == [01]", line), line
            out.append(bits[ptr["a"]])
    return out


@pytest.mark.parametrize("m", [5, 8, 16, 64])
def test_state_programs_are_right(m) -> None:
    tok = ProgramTokenizer()
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 256 + 15 and tok.pad_id == tok.eos_id
    rng = random.Random(m)
    for _ in range(20):
        words, answers = make_program(m, m, rng)
        ids, supervised = encode_program(words, answers, tok)
        assert len(ids) == program_tokens(m, m) and ids[-1] == tok.eos_id
        assert sum(supervised) == m and [ids[i] for i in answers] == [ids[i] for i, s in enumerate(supervised) if s]
        text = tok.decode(ids)
        assert tok.encode(text) == ids[:-1]  # round trip (eos is dropped by decode)
        lines = text.splitlines()
        assert len(lines) == 2 + 2 * m
        assert lines[2::2] == [ln for ln in lines if ln.endswith(";")]  # a swap, then its assertion, n times
        # The supervised tokens are the bits asserted, in order, and right:
        assert [int(tok.word_of(ids[i])) for i in answers] == simulate(text)
        exec(text, {})  # the program is Python: every assertion holds
        pointers = [int(v) for v in lines[1].split(" = ")[1].split(", ")]
        assert len(set(pointers)) == 5 and all(0 <= v < m for v in pointers)  # distinct, in [0, m)


def test_a_wrong_answer_fails_the_simulation() -> None:
    tok = ProgramTokenizer()
    words, answers = make_program(8, 8, random.Random(3))
    words[answers[4]] = str(1 - int(words[answers[4]]))
    text = tok.decode([tok.id_of(w) for w in words])
    with pytest.raises(AssertionError):
        exec(text, {})


def test_program_text_is_lt2s_listing() -> None:
    tok = ProgramTokenizer()
    text = tok.decode([tok.id_of(w) for w in make_program(8, 2, random.Random(0))[0]])
    assert re.fullmatch(
        r"bits = \[[01](,[01]){7}\]\n"
        r"a, b, c, d, e = \d, \d, \d, \d, \d\n"
        r"(([a-e]), ([a-e]) = \4, \3;\nassert bits\[a\] == [01]\n){2}",
        text,
    ), text
    assert tok.encode("bits = [1, 0]\n") == tok.encode("bits=[1,0]\n")  # spaces carry nothing
    with pytest.raises(ValueError, match="outside"):
        tok.encode("bits[300]")
    with pytest.raises(ValueError, match="not part of the program vocabulary"):
        tok.encode("x = 1")
