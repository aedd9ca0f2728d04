"""The tasks' own vocabularies, behind looplm's :class:`~looplm.data.tokenizer.Tokenizer` protocol.

- :class:`CharacterTokenizer`: the 14 characters of autoregressive-TRM App. B.4 ("digits
  0–9, |, +, =, and newline"), one token each, in that order (ids 0–9 are the digits,
  10 ``|``, 11 ``+``, 12 ``=``, 13 newline). Newline ends every example, so it is the
  eos token; the paper has no pad token, and the authors' code pads with newline, so
  ``pad_id == eos_id`` (padded positions never carry a loss: their targets are -100).
- :class:`ProgramTokenizer`: the Python-like programs of LT2 §4.6, one token per word of
  the program: the numbers ``0 … max_index-1`` (ids equal to the number; bits are the
  numbers 0 and 1), then ``bits = [ ] , ; assert == a b c d e``, newline and ``<eos>``
  (also the pad). Whole numbers are single tokens, as a digit-grouping LM tokenizer
  (OLMo's, LLaMA-3's: up to three digits per token) would make them for m <= 256.

Both are frozen dataclasses, so equal configurations compare and hash alike.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Sequence

CHARACTERS = "0123456789|+=\n"


@dataclasses.dataclass(frozen=True)
class CharacterTokenizer:
    """One token per character of ``0123456789|+=\\n``; eos = pad = newline (id 13).

    ``decode`` keeps newlines (they are characters of the text, not markup), so
    ``decode(encode(s)) == s``; ``encode`` refuses any other character.
    """

    name: str = dataclasses.field(default="task:characters", init=False)
    vocab_size: int = dataclasses.field(default=len(CHARACTERS), init=False)
    eos_id: int = dataclasses.field(default=CHARACTERS.index("\n"), init=False)
    pad_id: int = dataclasses.field(default=CHARACTERS.index("\n"), init=False)

    def encode(self, text: str) -> list[int]:
        try:
            return [_CHAR_IDS[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the task vocabulary {CHARACTERS!r}") from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(CHARACTERS[int(i)] for i in ids if 0 <= int(i) < len(CHARACTERS))


_CHAR_IDS = {c: i for i, c in enumerate(CHARACTERS)}

#: Program words after the numbers, in id order.
PROGRAM_SYMBOLS = ("bits", "=", "[", "]", ",", ";", "assert", "==", "a", "b", "c", "d", "e", "\n", "<eos>")
POINTERS = ("a", "b", "c", "d", "e")
_WORD = re.compile(r"(\d+|assert|bits|==|<eos>|[a-e=\[\],;\n])|([ \t]+)|(.)", re.S)


@dataclasses.dataclass(frozen=True)
class ProgramTokenizer:
    """Word-level tokens for the state-tracking programs; numbers ``0 … max_index-1`` are
    ids ``0 … max_index-1``; ``<eos>`` ends a program and is also the pad.

    ``encode`` splits at words and ignores spaces; ``decode`` writes the canonical
    spacing of LT2's listing (``bits = [1,0,1]``, ``a, c = c, a;``, ``assert bits[a] == 0``)
    and drops ``<eos>``, so ``encode(decode(ids)) == ids`` for ids without ``<eos>``.
    """

    max_index: int = 256
    name: str = dataclasses.field(init=False)
    vocab_size: int = dataclasses.field(init=False)
    eos_id: int = dataclasses.field(init=False)
    pad_id: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("name", f"task:program{self.max_index}")
        set_("vocab_size", self.max_index + len(PROGRAM_SYMBOLS))
        set_("eos_id", self.max_index + PROGRAM_SYMBOLS.index("<eos>"))
        set_("pad_id", self.eos_id)

    def id_of(self, word: str) -> int:
        """The id of one program word (a number or a symbol)."""
        if word.isdigit():
            number = int(word)
            if number >= self.max_index:
                raise ValueError(f"number {number} is outside this program vocabulary's 0..{self.max_index - 1}")
            return number
        return self.max_index + PROGRAM_SYMBOLS.index(word)

    def word_of(self, token: int) -> str:
        token = int(token)
        return str(token) if token < self.max_index else PROGRAM_SYMBOLS[token - self.max_index]

    def encode(self, text: str) -> list[int]:
        ids = []
        for match in _WORD.finditer(text):
            word, _, bad = match.groups()
            if bad is not None:
                raise ValueError(f"{bad!r} at offset {match.start()} is not part of the program vocabulary")
            if word is not None:
                ids.append(self.id_of(word))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        previous, in_brackets = "\n", False
        for token in ids:
            if int(token) == self.eos_id or not 0 <= int(token) < self.vocab_size:
                continue
            word = self.word_of(token)
            tight = (
                previous in ("\n", "[")
                or word in (",", ";", "]", "\n")
                or (word == "[" and previous == "bits")
                or (in_brackets and previous == ",")
            )
            out.append(word if tight else " " + word)
            in_brackets = (in_brackets or word == "[") and word != "]"
            previous = word
        return "".join(out)
