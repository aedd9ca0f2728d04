"""TrainStream and validation_batches: exact resume, epochs, data parallelism, streaming, errors."""

from __future__ import annotations

import json

import pytest
import torch

from data_helpers import make_documents, write_jsonl
from looplm.config_base import ConfigError
from looplm.data import ByteTokenizer, DataConfig, TrainStream, validation_batches

TOK = ByteTokenizer()


@pytest.fixture
def corpus_cfg(tmp_path) -> DataConfig:
    """33 training windows of 25 tokens per epoch; 5 held-out windows by the hash rule alone."""
    docs = make_documents(24, max_words=6)
    return DataConfig(source=str(write_jsonl(tmp_path / "c.jsonl", docs)), seq_len=24, val_fraction=0.2)


def draw(stream: TrainStream, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(stream) for _ in range(count)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_exact_resume_across_epoch_boundaries(corpus_cfg, shuffle, streaming) -> None:
    cfg = corpus_cfg.replace(shuffle=shuffle, streaming=streaming)
    for k in (0, 3, 7, 11):  # 0, 12, 28 and 44 windows drawn; the 12 more cross one or two epoch ends
        stream = TrainStream(cfg, TOK, batch_size=4, shuffle_buffer=5)
        draw(stream, k)
        state = json.loads(json.dumps(stream.state_dict()))  # JSON-able
        expected = draw(stream, 12)
        resumed = TrainStream(cfg, TOK, batch_size=4, shuffle_buffer=5)
        resumed.load_state_dict(state)
        assert same(draw(resumed, 12), expected)
    assert stream.epoch >= 2  # the draws did cross epoch boundaries


def test_resume_refuses_different_data(corpus_cfg) -> None:
    stream = TrainStream(corpus_cfg, TOK, batch_size=2)
    state = stream.state_dict()
    other = TrainStream(corpus_cfg.replace(seq_len=12), TOK, batch_size=2)
    with pytest.raises(ValueError, match="windows per epoch"):
        other.load_state_dict(state)


def epoch_rows(stream: TrainStream, per_epoch: int) -> list[torch.Tensor]:
    """The next ``per_epoch`` windows, one per batch of size 1."""
    return [torch.cat([x, y[:, -1:]], dim=1)[0] for x, y in draw(stream, per_epoch)]


@pytest.mark.parametrize("streaming", [False, True])
def test_epochs_reshuffle_the_same_windows(corpus_cfg, streaming) -> None:
    plain = TrainStream(corpus_cfg.replace(shuffle=False, streaming=streaming), TOK, batch_size=1)
    n = TrainStream(corpus_cfg, TOK, batch_size=1).windows_per_epoch
    first, second = epoch_rows(plain, n), epoch_rows(plain, n)
    assert all(torch.equal(a, b) for a, b in zip(first, second))  # no shuffle: every epoch alike

    shuffled = TrainStream(corpus_cfg.replace(streaming=streaming), TOK, batch_size=1, shuffle_buffer=8)
    e0, e1 = epoch_rows(shuffled, n), epoch_rows(shuffled, n)
    key = lambda rows: sorted(tuple(r.tolist()) for r in rows)  # noqa: E731
    assert key(e0) == key(e1) == key(first)  # each epoch is a permutation of the same windows
    assert [r.tolist() for r in e0] != [r.tolist() for r in first]
    assert [r.tolist() for r in e0] != [r.tolist() for r in e1]  # reshuffled per epoch

    again = TrainStream(corpus_cfg.replace(streaming=streaming), TOK, batch_size=1, shuffle_buffer=8)
    assert all(torch.equal(a, b) for a, b in zip(epoch_rows(again, n), e0))  # seeded: reproducible
    other_seed = TrainStream(corpus_cfg.replace(streaming=streaming, seed=1), TOK, batch_size=1, shuffle_buffer=8)
    assert [r.tolist() for r in epoch_rows(other_seed, n)] != [r.tolist() for r in e0]


def test_streaming_packs_like_in_memory(corpus_cfg) -> None:
    cfg = corpus_cfg.replace(shuffle=False)
    n = 20
    assert same(draw(TrainStream(cfg.replace(streaming=True), TOK, 3), n), draw(TrainStream(cfg, TOK, 3), n))
    assert same(validation_batches(cfg.replace(streaming=True), TOK, 2), validation_batches(cfg, TOK, 2))


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_data_parallel_ranks_split_the_global_batch(corpus_cfg, shuffle, streaming) -> None:
    cfg = corpus_cfg.replace(shuffle=shuffle, streaming=streaming)
    whole = TrainStream(cfg, TOK, batch_size=6)
    ranks = [TrainStream(cfg, TOK, batch_size=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(12):  # several epochs: global batches straddle epoch boundaries
        x, y = next(whole)
        (x0, y0), (x1, y1) = next(ranks[0]), next(ranks[1])
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        rows0, rows1 = {tuple(r.tolist()) for r in x0}, {tuple(r.tolist()) for r in x1}
        assert not rows0 & rows1
    assert ranks[0].state_dict() == ranks[1].state_dict() == whole.state_dict()  # one global position


def test_validation_batches(corpus_cfg) -> None:
    from looplm.data.packing import packed_corpus

    val = packed_corpus(corpus_cfg, TOK).val.long()
    assert val.shape[0] >= 4
    batches = validation_batches(corpus_cfg, TOK, batch_size=2)
    assert len(batches) == min(corpus_cfg.val_batches, val.shape[0] // 2)
    assert same(batches, validation_batches(corpus_cfg, TOK, batch_size=2))  # always the same ones
    for k, (x, y) in enumerate(batches):
        assert torch.equal(x, val[2 * k : 2 * k + 2, :-1]) and torch.equal(y, val[2 * k : 2 * k + 2, 1:])
    ranks = [validation_batches(corpus_cfg, TOK, batch_size=1, rank=r, world_size=2) for r in range(2)]
    assert same([(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*ranks)], batches)
    assert len(validation_batches(corpus_cfg.replace(val_batches=1), TOK, batch_size=2)) == 1
    assert validation_batches(corpus_cfg.replace(val_fraction=0.0), TOK, batch_size=2) == []
    # fewer windows than one global batch: the batch shrinks rather than vanish
    (small,) = validation_batches(corpus_cfg, TOK, batch_size=val.shape[0] + 5)
    assert small[0].shape == (val.shape[0], corpus_cfg.seq_len)


@pytest.mark.parametrize("streaming", [False, True])
def test_corpus_smaller_than_one_window(tmp_path, streaming) -> None:
    cfg = DataConfig(source=str(write_jsonl(tmp_path / "c.jsonl", ["tiny", "docs"])), seq_len=64,
                     val_fraction=0.0, streaming=streaming)
    with pytest.raises(ConfigError, match="a window needs seq_len \\+ 1 = 65 tokens") as err:
        next(TrainStream(cfg, TOK, batch_size=2))
    assert err.value.field == "data.seq_len"


@pytest.mark.parametrize("streaming", [False, True])
def test_stream_construction_checks_the_source(tmp_path, streaming) -> None:
    with pytest.raises(ConfigError) as err:
        TrainStream(DataConfig(source=str(tmp_path / "nope.jsonl"), streaming=streaming), TOK, batch_size=2)
    assert err.value.field == "data.source"


def test_bad_parallel_arguments(corpus_cfg) -> None:
    with pytest.raises(ValueError, match="rank=2"):
        TrainStream(corpus_cfg, TOK, batch_size=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size=0"):
        validation_batches(corpus_cfg, TOK, batch_size=0)


def test_hf_streaming_dataset_trains_and_resumes(tmp_path) -> None:
    import datasets

    docs = make_documents(24, max_words=6)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "ds"))
    cfg = DataConfig(source=f"hf:{tmp_path / 'ds'}", seq_len=24, val_fraction=0.2, streaming=True)
    local = DataConfig(source=str(write_jsonl(tmp_path / "c.jsonl", docs)), seq_len=24,
                       val_fraction=0.2, streaming=True)
    stream = TrainStream(cfg, TOK, batch_size=4, shuffle_buffer=5)
    assert same(draw(stream, 5), draw(TrainStream(local, TOK, batch_size=4, shuffle_buffer=5), 5))
    state = stream.state_dict()
    expected = draw(stream, 6)  # windows 20..43 of a 33-window epoch
    resumed = TrainStream(cfg, TOK, batch_size=4, shuffle_buffer=5)
    resumed.load_state_dict(state)
    assert same(draw(resumed, 6), expected)
