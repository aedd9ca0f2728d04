"""Corpus perplexity: strided windows, token / byte / word normalisations, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from looplm.cli import main
from looplm.data import ByteTokenizer
from looplm.model import LoopLM
from looplm.eval.perplexity import corpus_perplexity, strided_windows
from looplm.eval.scoring import Window, score_windows
from tests.conftest import tiny_config

TEXT = "The quick  brown fox\njumps over the lazy dog. " * 3  # 135 bytes, 27 words (runs of whitespace)


@pytest.fixture(scope="module")
def model() -> LoopLM:
    torch.manual_seed(0)
    return LoopLM(tiny_config("anchor", vocab_size=257, max_seq_len=64)).eval()


def nll_of(model: LoopLM, inputs: list[int], targets: list[int]) -> float:
    """Σ −log p(targets) from one plain forward of ``inputs`` (same length)."""
    with torch.no_grad():
        logits = model(torch.tensor([inputs])).logits[0].float()
    return float(F.cross_entropy(logits, torch.tensor(targets), reduction="sum"))


def test_windows_score_each_token_once_with_the_promised_context():
    tokens = list(range(100, 150))  # 50 tokens
    for window, stride in [(16, 16), (16, 5), (16, 1), (64, 7)]:
        windows = strided_windows(tokens, 7, window, stride)
        assert sum(w.scored for w in windows) == len(tokens)
        assert windows[0].tokens[0] == 7  # the first token is conditioned on the prefix
        scored = [t for w in windows for t in w.tokens[len(w.tokens) - w.scored :]]
        assert scored == tokens
        for w in windows[1:]:
            assert len(w.tokens) - 1 <= window
            assert len(w.tokens) - 1 - w.scored >= window - stride  # context carried over


def test_stride_equal_to_window_is_disjoint_windows(model):
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    window = 16
    result = corpus_perplexity(model, tok, [TEXT], window=window, stride=window)
    x = [tok.eos_id, *ids]
    expected = 0.0
    for begin in range(0, len(ids), window):  # disjoint chunks, no context carried over
        end = min(begin + window, len(ids))
        expected += nll_of(model, x[begin:end], x[begin + 1 : end + 1])
    assert result.nll == pytest.approx(expected, rel=1e-5)
    assert result.tokens == len(ids)


def test_sliding_window_equals_per_token_computation(model):
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)[:40]
    window, stride = 12, 5
    result = corpus_perplexity(model, tok, [tok.decode(ids)], window=window, stride=stride, batch_size=3)
    x = [tok.eos_id, *ids]
    expected, done = 0.0, 0
    for begin in range(0, len(ids), stride):  # Hugging Face's perplexity guide, one window at a time
        end = min(begin + window, len(ids))
        with torch.no_grad():
            logits = model(torch.tensor([x[begin:end]])).logits[0].float()
        logp = logits.log_softmax(-1)
        for pos in range(done, end):  # predict x[pos + 1] from position pos - begin
            expected -= float(logp[pos - begin, x[pos + 1]])
        done = end
        if end == len(ids):
            break
    assert result.nll == pytest.approx(expected, rel=1e-5)


def test_document_shorter_than_window_is_one_forward(model):
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)[:30]
    result = corpus_perplexity(model, tok, [tok.decode(ids)])  # window = max_seq_len = 64
    x = [tok.eos_id, *ids]
    loss = nll_of(model, x[:-1], x[1:]) / len(ids)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    assert result.token_ppl == pytest.approx(math.exp(loss), rel=1e-5)


def test_bits_per_byte_and_word_perplexity(model):
    tok = ByteTokenizer()
    docs = [TEXT, "", "héllo wörld\n\n  again"]  # the empty document is skipped; é, ö are two bytes
    result = corpus_perplexity(model, tok, docs, window=32, stride=16)
    assert result.documents == 2
    assert result.bytes == len(TEXT.encode()) + len(docs[2].encode()) == result.tokens
    assert result.words == 27 + 3
    assert result.bits_per_byte == pytest.approx(result.nll / (math.log(2) * result.bytes))
    assert result.word_ppl == pytest.approx(math.exp(result.nll / 30))


def test_batching_and_padding_change_nothing(model):
    tok = ByteTokenizer()
    docs = [TEXT[:n] for n in (5, 17, 40, 90, 135)]
    one = corpus_perplexity(model, tok, docs, window=24, stride=10, batch_size=1)
    four = corpus_perplexity(model, tok, docs, window=24, stride=10, batch_size=4)
    assert four.nll == pytest.approx(one.nll, rel=1e-6)
    windows = [Window(tokens=list(range(3, 3 + n)), scored=k) for n, k in [(5, 2), (30, 29), (9, 0), (17, 4)]]
    alone = [score_windows(model, [w])[0] for w in windows]
    together = score_windows(model, windows, batch_size=4)
    for a, b in zip(alone, together):
        assert b.logprob == pytest.approx(a.logprob, rel=1e-6, abs=1e-6)
        assert b.greedy == a.greedy


def test_eval_corpora_through_the_cli(tmp_path, model, capsys, caplog):
    model.save_pretrained(tmp_path / "run")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": TEXT}) + "\n" + json.dumps({"text": "short one"}) + "\n")
    (tmp_path / "b.txt").write_text(TEXT)
    run = str(tmp_path / "run")
    args = ["eval", run, "--corpus", f"a={tmp_path / 'a.jsonl'}", "--corpus", f"b={tmp_path / 'b.txt'}"]
    assert main([*args, "--window", "32", "--stride", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["corpora"]) == {"a", "b"} and result["window"] == 32 and result["stride"] == 8
    expected = corpus_perplexity(model, ByteTokenizer(), [TEXT], window=32, stride=8)
    assert result["corpora"]["b"]["nll"] == pytest.approx(expected.nll, rel=1e-5)
    assert result["corpora"]["a"]["documents"] == 2
    assert main(args) == 0
    assert "bits/byte" in capsys.readouterr().out

    assert main(["eval", str(tmp_path / "run"), "--corpus", "nameless"]) == 2
    assert "--corpus='nameless' is invalid: NAME=PATH" in caplog.text
    assert main([*args, "--window", "8", "--stride", "9"]) == 2
    assert "stride=9 is invalid: an integer in [1, window=8]" in caplog.text
    assert main(["eval", str(tmp_path / "run"), "--corpus", f"c={tmp_path / 'missing.txt'}"]) == 2
    assert "corpus 'c': data.source=" in caplog.text
    assert main(["eval", str(tmp_path / "run"), "--stride", "4"]) == 2
    assert "--stride and --window apply to --corpus" in caplog.text


def test_a_bpe_model_is_normalised_by_its_own_tokens_but_the_same_bytes_and_words(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.save(str(tmp_path / "tokenizer.json"))
    from looplm.data import build_tokenizer

    tok = build_tokenizer(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    bpe = LoopLM(tiny_config("anchor", vocab_size=tok.vocab_size, max_seq_len=64)).eval()
    result = corpus_perplexity(bpe, tok, [TEXT], window=8, stride=4)
    ids = tok.encode(TEXT)
    assert result.tokens == len(ids) < result.bytes == len(TEXT.encode())
    assert result.words == 27
    assert result.token_ppl == pytest.approx(math.exp(result.nll / len(ids)))
    assert result.bits_per_byte == pytest.approx(result.nll / (math.log(2) * len(TEXT.encode())))
