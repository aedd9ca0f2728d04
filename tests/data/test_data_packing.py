"""Packing into windows and the held-out split: contiguity, shift, disjointness, stability, cache."""

from __future__ import annotations

import hashlib

import torch

from data_helpers import make_documents, write_jsonl
from looplm.data import ByteTokenizer, DataConfig, TrainStream
from looplm.data.packing import packed_corpus
from looplm.data.split import document_unit, is_validation, split_documents

TOK = ByteTokenizer()


def joined(docs: list[str]) -> torch.Tensor:
    """The eos-joined token stream of ``docs``, built independently of the packer."""
    ids: list[int] = []
    for d in docs:
        ids += list(d.encode("utf-8")) + [TOK.eos_id]
    return torch.tensor(ids)


def test_windows_are_consecutive_slices_of_the_eos_joined_stream(tmp_path) -> None:
    docs = make_documents(200)
    cfg = DataConfig(source=str(write_jsonl(tmp_path / "c.jsonl", docs)), seq_len=37, val_fraction=0.2)
    corpus = packed_corpus(cfg, TOK)
    held = [is_validation(d, 0.2) for d in docs]
    assert 0 < sum(held) < len(docs)  # the hash rule alone made a split: no fallback here
    for windows, part in ((corpus.train, [d for d, h in zip(docs, held) if not h]),
                          (corpus.val, [d for d, h in zip(docs, held) if h])):
        stream = joined(part)
        assert windows.shape == (stream.numel() // 38, 38)  # the remainder is dropped
        assert torch.equal(windows.flatten().long(), stream[: windows.numel()])
    assert (corpus.train_documents, corpus.val_documents) == (len(docs) - sum(held), sum(held))


def test_batches_are_shifted_windows(tmp_path) -> None:
    docs = make_documents(60)
    cfg = DataConfig(source=str(write_jsonl(tmp_path / "c.jsonl", docs)), seq_len=16, val_fraction=0.0, shuffle=True)
    stream = joined(docs)
    starts = set()
    stream_iter = TrainStream(cfg, TOK, batch_size=5)
    for _ in range(4):
        x, y = next(stream_iter)
        assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
        for row in torch.cat([x, y[:, -1:]], dim=1):
            (hits,) = torch.nonzero(stream.unfold(0, 17, 17).eq(row).all(dim=1), as_tuple=True)
            assert hits.numel() >= 1  # each row is one aligned window of the stream
            starts.add(int(hits[0]))
    assert len(starts) == 20  # and no window repeats within an epoch


def test_hash_rule_is_stable_and_order_free() -> None:
    text = "a document ü"
    expected = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big") / 2**64
    assert document_unit(text) == expected  # not Python's salted hash(): the same everywhere
    docs = make_documents(3000)
    held = [is_validation(d, 0.1) for d in docs]
    assert 0.08 < sum(held) / len(docs) < 0.12
    units, lengths = [document_unit(d) for d in docs], [len(d) for d in docs]
    assert split_documents(units, lengths, 0.1, window=10) == held
    perm = torch.randperm(len(docs), generator=torch.Generator().manual_seed(0)).tolist()
    permuted = split_documents([units[i] for i in perm], [lengths[i] for i in perm], 0.1, window=10)
    assert permuted == [held[i] for i in perm]


def test_tiny_corpus_fallback_holds_out_lowest_hash_documents() -> None:
    units = [0.9, 0.3, 0.5, 0.2, 0.7]
    lengths = [10, 10, 10, 10, 10]
    # nothing below 0.01: documents move in increasing unit order until validation holds one window
    assert split_documents(units, lengths, 0.01, window=15) == [False, True, False, True, False]
    # but never so many that training loses its last window
    assert split_documents(units, lengths, 0.01, window=25) == [False, True, False, True, False]
    assert split_documents([0.4], [100], 0.01, window=15) == [False]
    assert split_documents(units, lengths, 0.0, window=15) == [False] * 5  # no validation asked for
    # duplicates (equal units) move together
    assert split_documents([0.2, 0.2, 0.9], [10, 10, 30], 0.01, window=5) == [True, True, False]


def test_tiny_corpus_gets_a_validation_window(tmp_path) -> None:
    docs = [d for d in make_documents(40) if not is_validation(d, 0.01)][:6]
    cfg = DataConfig(source=str(write_jsonl(tmp_path / "c.jsonl", docs)), seq_len=30, val_fraction=0.01)
    corpus = packed_corpus(cfg, TOK)
    assert corpus.val.shape[0] >= 1 and corpus.train.shape[0] >= 1
    assert corpus.val_documents + corpus.train_documents == len(docs)
    lowest = min(docs, key=document_unit)
    assert torch.equal(corpus.val[0].long(), joined([lowest])[:31])


def test_pydoc_byte_packing_counts_and_cache() -> None:
    from pydoc_data.topics import topics

    cfg = DataConfig(source="pydoc", seq_len=128)
    corpus = packed_corpus(cfg, TOK)
    assert corpus.train_tokens + corpus.val_tokens == sum(len(t.encode("utf-8")) + 1 for t in topics.values() if t)
    assert corpus.val_tokens > 0
    # fields that do not change the packing share the cached corpus; seq_len does not
    assert packed_corpus(cfg.replace(seed=3, shuffle=False, val_batches=1), ByteTokenizer()) is corpus
    assert packed_corpus(cfg.replace(seq_len=64), TOK) is not corpus


def test_empty_documents_are_skipped(tmp_path) -> None:
    docs = make_documents(30)
    with_empty = [""] + docs[:10] + ["", ""] + docs[10:]
    cfg = DataConfig(source=str(write_jsonl(tmp_path / "a.jsonl", with_empty)), seq_len=20, val_fraction=0.0)
    corpus = packed_corpus(cfg, TOK)
    assert torch.equal(corpus.train.flatten().long(), joined(docs)[: corpus.train.numel()])


def test_packing_with_a_trained_tokenizer(tmp_path, bpe_tokenizer_json) -> None:
    from looplm.data import build_tokenizer

    tok = build_tokenizer(str(bpe_tokenizer_json))
    docs = make_documents(40)
    cfg = DataConfig(source=str(write_jsonl(tmp_path / "a.jsonl", docs)), seq_len=15, val_fraction=0.0)
    ids: list[int] = []
    for d in docs:
        ids += tok.encode(d) + [tok.eos_id]
    corpus = packed_corpus(cfg, tok)
    assert corpus.train.shape[0] == len(ids) // 16
    assert corpus.train.flatten().tolist() == ids[: corpus.train.numel()]
    assert packed_corpus(cfg, build_tokenizer(str(bpe_tokenizer_json))) is corpus  # same file: cache hit
