"""RULER needle-in-a-haystack (looplm.eval.niah): examples of the requested length with the needle
at the requested depth, deterministic by seed; exact-match scoring; an oracle scores 100 %
and a random model about 0; the CLI writes the table."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import torch

from looplm.artifacts import CONFIG_FILE, MODEL_FILE, write_manifest
from looplm.cli import main
from looplm.config import RunConfig
from looplm.config_base import ConfigError
from looplm.data import DataConfig
from looplm.data.tokenizer import ByteTokenizer
from looplm.model import LoopLM
from looplm.eval.niah import (
    MAX_SENTENCE_CHARS, NEEDLE, TASKS, evaluate_niah, exact_match, generated_value, haystack_sentences, make_example,
    markdown_table,
)
from tests.conftest import tiny_config

TOKENIZER = ByteTokenizer()
ESSAY = ("Paul wrote essays about startups and painting. Some of them are long, and some of them are very short! "
         "Why do people read them? Because they are clear. ") * 3


@pytest.fixture(scope="module")
def essay_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "essays.txt"
    path.write_text(ESSAY + "\n\nA second paragraph, with a sentence that goes on " + "and on " * 30 + "until it ends.\n")
    return path


@pytest.fixture(scope="module")
def essay(essay_file) -> list[str]:
    return haystack_sentences(str(essay_file))


def _model(max_seq_len: int = 640, seed: int = 0) -> LoopLM:
    torch.manual_seed(seed)
    return LoopLM(tiny_config("anchor", vocab_size=TOKENIZER.vocab_size, max_seq_len=max_seq_len)).eval()


def _context(prompt: str) -> str:
    """The haystack with the needle: the template's second line."""
    return prompt.split("\n")[1]


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [460, 513, 777])
def test_example_has_the_requested_length(task, length, essay):
    """prompt + answer budget <= length, short of it by less than one haystack sentence."""
    for depth in (0, 50, 100):
        example = make_example(TASKS[task], TOKENIZER, length, depth, index=1, seed=3, essay=essay)
        total = len(TOKENIZER.encode(example.prompt)) + example.budget
        assert example.prompt_tokens + example.budget == total
        assert length - (MAX_SENTENCE_CHARS + 1) < total <= length  # byte tokenizer, ASCII corpus: chars = tokens


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("depth", [0, 10, 25, 50, 75, 90, 100])
def test_needle_sits_at_the_requested_depth(task, depth, essay):
    example = make_example(TASKS[task], TOKENIZER, 900, depth, index=0, seed=0, essay=essay)
    needle = NEEDLE.format(kind=TASKS[task].kind, key=example.key, value=example.value)
    context = _context(example.prompt)
    assert context.count(needle) == 1 and example.prompt.count(example.value) == 1
    before, after = context.split(needle)
    haystack = len(before.strip()) + len(after.strip())
    share = len(before.strip()) / haystack
    assert share == pytest.approx(example.needle_depth)
    assert abs(share - depth / 100) <= (MAX_SENTENCE_CHARS + 1) / haystack  # the closest sentence boundary
    assert before == "" or before.endswith(". ") or before.endswith("! ") or before.endswith("? ") or \
        before[-1] == " "  # between sentences, never inside a word
    assert example.prompt.endswith(f"for {example.key} mentioned in the provided text are")


def test_examples_are_deterministic_by_seed(essay):
    task = TASKS["niah_single_3"]
    a = make_example(task, TOKENIZER, 520, 50, index=2, seed=7, essay=essay)
    assert a == make_example(task, TOKENIZER, 520, 50, index=2, seed=7, essay=essay)
    others = [make_example(task, TOKENIZER, 520, 50, index=3, seed=7, essay=essay),
              make_example(task, TOKENIZER, 520, 50, index=2, seed=8, essay=essay)]
    assert all(o.value != a.value for o in others)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", a.value)
    number = make_example(TASKS["niah_single_1"], TOKENIZER, 520, 50, index=0, seed=7)
    assert re.fullmatch(r"[1-9][0-9]{6}", number.value) and re.fullmatch(r"[a-z]+-[a-z]+", number.key)


def test_haystacks_differ_by_task(essay):
    repeat = make_example(TASKS["niah_single_1"], TOKENIZER, 520, 50, index=0, seed=0)
    prose = make_example(TASKS["niah_single_2"], TOKENIZER, 520, 50, index=0, seed=0, essay=essay)
    assert "The grass is green. The sky is blue." in repeat.prompt and "grass" not in prose.prompt
    assert "essays" in prose.prompt and "special magic numbers" in prose.prompt


def test_exact_match():
    assert exact_match(" 1234567.", "1234567") and exact_match("1234567\nmore", "1234567")
    assert exact_match(" 1234567, and more", "1234567")
    assert not exact_match(" 12345678.", "1234567") and not exact_match(" 123456.", "1234567")
    assert not exact_match(" the number 1234567.", "1234567") and not exact_match("", "1234567")
    uid = "0f2a9c1e-4b7d-4e2a-9c3b-1d2e3f4a5b6c"
    assert exact_match(f" {uid}.", uid) and not exact_match(f" {uid[:-1]}.", uid)
    assert generated_value("   ") == ""


def _oracle(prompts, max_new_tokens, **_):
    """A model that reads the needle: the value stated for the asked key, then eos."""
    rows = []
    for ids in prompts:
        text = TOKENIZER.decode(ids)
        key = re.search(r"magic \w+ for (\S+) mentioned in the provided text\?", text).group(1)
        value = re.search(rf"for {re.escape(key)} is: (\S+)\.", text).group(1)
        answer = TOKENIZER.encode(f" {value}.") + [TOKENIZER.eos_id]
        assert len(answer) <= max_new_tokens
        rows.append(answer)
    return types.SimpleNamespace(new_tokens=rows)


def test_an_oracle_scores_100_and_a_random_model_about_0(monkeypatch, essay_file):
    grid = dict(lengths=[460, 600], depths=[0, 50, 100], samples=2, haystack=f"essay:{essay_file}")
    model = _model()
    random_result = evaluate_niah(model, TOKENIZER, batch_size=2, **grid)
    assert len(random_result.examples) == 3 * 2 * 3 * 2
    assert all(random_result.accuracy(t) == 0.0 for t in TASKS)
    monkeypatch.setattr(model, "generate", _oracle)
    oracle = evaluate_niah(model, TOKENIZER, **grid)
    assert all(cell["accuracy"] == 100.0 for cell in oracle.cells())
    table = markdown_table(oracle)
    assert table.splitlines()[0].startswith("| niah_single_1 460 | niah_single_1 600 | niah_single_2 460")
    assert "| 50 | 100.0 | 100.0 |" in table


def test_lengths_beyond_the_model_are_refused():
    with pytest.raises(ConfigError, match=r"lengths=\[512, 4096\].*max_seq_len=640.*--lengths"):
        evaluate_niah(_model(), TOKENIZER, lengths=[512, 4096], samples=1)
    with pytest.raises(ConfigError, match="haystack"):
        evaluate_niah(_model(), TOKENIZER, lengths=[512], samples=1, haystack="essays")
    with pytest.raises(ConfigError, match=r"lengths=40 .*at least"):  # the template alone is longer
        make_example(TASKS["niah_single_1"], TOKENIZER, 40, 0, 0)


def _run_dir(directory: Path, model: LoopLM) -> Path:
    model.save_pretrained(directory)
    config = RunConfig(model=model.cfg, data=DataConfig(tokenizer="byte"))
    (directory / CONFIG_FILE).write_text(json.dumps(config.to_dict()))
    write_manifest(directory, [MODEL_FILE, CONFIG_FILE])
    return directory


def test_cli_writes_the_table_json_and_figure(tmp_path, capsys, essay_file):
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path / "run", _model())
    out = tmp_path / "niah"
    code = main(["niah", str(run), "--lengths", "460", "600", "--depths", "0", "100", "--samples", "2",
                 "--haystack", f"essay:{essay_file}", "--out", str(out), "--tasks", "niah_single_1", "niah_single_3"])
    assert code == 0
    table = (out / "niah.md").read_text()
    assert table.startswith("| niah_single_1 460 | niah_single_1 600 | niah_single_3 460 | niah_single_3 600 |")
    assert table in capsys.readouterr().out
    data = json.loads((out / "niah.json").read_text())
    assert data["tasks"] == ["niah_single_1", "niah_single_3"] and len(data["examples"]) == 2 * 2 * 2 * 2
    assert set(data["summary"]["niah_single_3"]) == {"460", "600"}
    assert (out / "niah.png").stat().st_size > 0


def test_cli_refuses_a_length_beyond_the_context(tmp_path, caplog):
    run = _run_dir(tmp_path / "run", _model())
    assert main(["niah", str(run), "--lengths", "1024", "--no-figures", "--out", str(tmp_path / "o")]) == 2
    assert "--lengths" in caplog.text and "max_seq_len=640" in caplog.text


def test_lengths_count_tokens_of_a_bpe_tokenizer(tmp_path, essay):
    """Under a BPE vocabulary a length is still prompt + budget in its tokens, short of the
    target by less than one haystack sentence."""
    tokenizers = pytest.importorskip("tokenizers")
    from looplm.data.tokenizer import build_tokenizer

    raw = tokenizers.Tokenizer(tokenizers.models.BPE())
    raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator([ESSAY] * 5, trainer)
    raw.save(str(tmp_path / "tokenizer.json"))
    bpe = build_tokenizer(str(tmp_path / "tokenizer.json"))
    longest = max(len(bpe.encode(" " + s)) for s in essay + ["The grass is green."])
    for task in TASKS.values():
        for length in (500, 900):
            example = make_example(task, bpe, length, 50, index=0, seed=1, essay=essay)
            total = len(bpe.encode(example.prompt)) + example.budget
            assert length - longest - 1 <= total <= length
            assert bpe.decode(bpe.encode(example.prompt)) == example.prompt
