"""Tokenizers: byte round trip and ids, Hugging Face tokenizers from a JSON file and a directory."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from looplm.config_base import ConfigError
from looplm.data import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)))  # no lone surrogates: not UTF-8


@given(TEXT)
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id]) == text  # special ids are dropped


def test_byte_ids_and_identity() -> None:
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.name) == (257, 256, 256, "byte")
    assert tok == ByteTokenizer() and hash(tok) == hash(ByteTokenizer())
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character decodes with a replacement


def _raw(path):
    from tokenizers import Tokenizer as RawTokenizer

    return RawTokenizer.from_file(str(path))


def test_tokenizers_json(bpe_tokenizer_json) -> None:
    raw = _raw(bpe_tokenizer_json)
    tok = build_tokenizer(str(bpe_tokenizer_json))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.eos_id == raw.token_to_id("<|endoftext|>")
    assert tok.pad_id == tok.eos_id  # no pad token: pad with eos
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    text = "hello world, the quick brown fox ü"
    ids = tok.encode(text)
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned and are used
    assert tok.eos_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id]) == text
    assert tok == HFTokenizer(bpe_tokenizer_json) and hash(tok) == hash(HFTokenizer(bpe_tokenizer_json))


def test_transformers_directory(bpe_tokenizer_json, tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=_raw(bpe_tokenizer_json), eos_token="<|endoftext|>", pad_token="<pad>"
    )
    fast.save_pretrained(str(tmp_path / "hf_tok"))
    tok = build_tokenizer(str(tmp_path / "hf_tok"))
    json_tok = build_tokenizer(str(bpe_tokenizer_json))
    assert isinstance(tok, HFTokenizer)
    text = "the quick brown fox, hello world"
    assert tok.encode(text) == json_tok.encode(text)
    assert tok.decode(tok.encode(text) + [tok.eos_id]) == text
    assert tok.eos_id == json_tok.eos_id
    assert tok.pad_id == fast.pad_token_id != tok.eos_id  # the added pad token is used
    assert tok.vocab_size == len(fast) == json_tok.vocab_size + 1


def test_bare_json_eos_lookup_and_missing_eos(tmp_path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    def word_level(specials: list[str], name: str):
        raw = RawTokenizer(models.WordLevel(unk_token="[UNK]"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(special_tokens=specials, show_progress=False)
        raw.train_from_iterator(["a b c", "b c d"], trainer)
        raw.save(str(tmp_path / name))
        return raw, str(tmp_path / name)

    raw, path = word_level(["[UNK]", "</s>", "<pad>"], "with_eos.json")
    tok = build_tokenizer(path)
    assert (tok.eos_id, tok.pad_id) == (raw.token_to_id("</s>"), raw.token_to_id("<pad>"))
    assert tok.decode(tok.encode("a b d")) == "a b d"

    _, path = word_level(["[UNK]"], "no_eos.json")
    with pytest.raises(ConfigError) as err:
        build_tokenizer(path)
    assert err.value.field == "data.tokenizer" and "<|endoftext|>" in str(err.value)


def test_tokenizer_path_errors(tmp_path) -> None:
    with pytest.raises(ConfigError) as err:
        build_tokenizer(str(tmp_path / "missing.json"))
    assert err.value.field == "data.tokenizer" and "no such path" in str(err.value)
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ConfigError, match="data.tokenizer"):
        build_tokenizer(str(bad))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match="data.tokenizer"):
        build_tokenizer(str(tmp_path / "empty_dir"))
