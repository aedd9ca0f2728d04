"""Each metric on hand-made predictions."""

from __future__ import annotations

import pytest
import torch

from looplm.tasks import CharacterScores, quartile_bounds, score


def test_exact_match_needs_the_whole_answer_and_nothing_more() -> None:
    m = score(["1234", "123", "12345", "1243"], ["1234"] * 4)
    assert m["exact_match"] == 0.25 and m["samples"] == 4


def test_character_accuracy_is_position_wise_over_the_target() -> None:
    assert score(["1243"], ["1234"])["char_acc"] == 0.5
    assert score(["12"], ["1234"])["char_acc"] == 0.5  # stopped early: the missing positions are wrong
    assert score(["123499"], ["1234"])["char_acc"] == 1.0  # ran on: scored on the target's length only
    assert score([""], ["1234"])["char_acc"] == 0.0
    assert score(["1234", "0000"], ["1234", "1234"])["char_acc"] == 0.5  # pooled over samples
    assert score(["12", "00000000"], ["12", "12345678"])["char_acc"] == 2 / 10  # micro average


def test_quartiles() -> None:
    assert quartile_bounds(8) == [0, 2, 4, 6, 8]
    assert quartile_bounds(11) == [0, 2, 5, 8, 11]  # the authors' boundaries: 2, 3, 3, 3 positions
    assert quartile_bounds(3) == [0, 0, 1, 2, 3]  # a short target leaves the first quartile empty
    m = score(["12345000"], ["12345678"])  # the last three positions wrong
    assert m["quartile_acc"] == [1.0, 1.0, 0.5, 0.0]
    m = score(["0bc", "abc"], ["abc", "abc"])
    assert m["quartile_acc"] == [None, 0.5, 1.0, 1.0]
    m = score(["99345678", "12345678"], ["12345678", "12345678"])
    assert m["quartile_acc"] == [0.5, 1.0, 1.0, 1.0]


def test_last_character() -> None:
    m = score(["1235", "1234", "12", "123"], ["1234"] * 4)
    assert m["last_char_acc"] == 0.25  # right only where position n - 1 holds the right character
    assert score(["0004"], ["1234"])["last_char_acc"] == 1.0


def test_counts_sum_across_ranks() -> None:
    pairs = [("1234", "1234"), ("1200", "1234"), ("9", "12"), ("777", "778")]
    whole = CharacterScores()
    parts = [CharacterScores(), CharacterScores()]
    for i, (p, t) in enumerate(pairs):
        whole.add(p, t)
        parts[i % 2].add(p, t)
    summed = CharacterScores.from_tensor(parts[0].as_tensor() + parts[1].as_tensor())
    assert summed == whole and summed.summary() == whole.summary()
    assert CharacterScores().summary()["char_acc"] is None
    with pytest.raises(ValueError):
        score(["1"], [])
    assert whole.as_tensor().dtype == torch.long
