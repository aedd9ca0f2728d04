"""Token shards: ``looplm tokenize`` (format, parallel, resume, no-op) and ``data.source=shards:DIR``
(the same windows, split, epochs, sharding and resume as packing in memory; refusals)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from data_helpers import make_documents, write_jsonl
from looplm.artifacts import CheckpointError
from looplm.config_base import ConfigError
from looplm.data import ByteTokenizer, DataConfig, TrainStream, build_tokenizer, validation_batches
from looplm.data.packing import packed_corpus
from looplm.data.shards import token_dtype
from looplm.data.split import document_unit
from looplm.data.tokenize_shards import tokenize_to_shards

TOK = ByteTokenizer()


@pytest.fixture
def corpus(tmp_path):
    """A folder of two jsonl files and a txt file (one empty document): 90 documents, ~9 KB."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    docs = make_documents(90, max_words=20)
    write_jsonl(folder / "a.jsonl", docs[:40])
    write_jsonl(folder / "b.jsonl", docs[40:80] + [""])
    (folder / "c.txt").write_text("\n\n".join(docs[80:]) + "\n", encoding="utf-8")
    return folder


def tokenize(source, out, tokenizer="byte", **kw):
    return tokenize_to_shards(str(source), out, tokenizer, shard_chars=kw.pop("shard_chars", 700), **kw)


def mtimes(directory):
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


def test_shards_hold_every_document_with_its_unit(corpus, tmp_path, bpe_tokenizer_json) -> None:
    out = tmp_path / "shards"
    result = tokenize(corpus, out, str(bpe_tokenizer_json))
    tok = build_tokenizer(str(bpe_tokenizer_json))
    manifest = json.loads((out / "manifest.json").read_text())
    assert result.shards == len(manifest["shards"]) > 3 and result.written == result.shards
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["vocab_size"] == tok.vocab_size
    from looplm.data.sources import iter_documents

    texts = [t for t in iter_documents(DataConfig(source=str(corpus))) if t]
    decoded, units = [], []
    for entry in manifest["shards"]:
        tokens = np.load(out / f"{entry['name']}.tokens.npy")
        offsets = np.load(out / f"{entry['name']}.offsets.npy")
        assert tokens.dtype == np.uint16 and offsets[-1] == tokens.size == entry["tokens"]
        for a, b in zip(offsets[:-1], offsets[1:]):
            assert tokens[b - 1] == tok.eos_id
            decoded.append(tokens[a:b - 1].tolist())
        units += np.load(out / f"{entry['name']}.units.npy").tolist()
    assert decoded == [tok.encode(t) for t in texts]  # every document, in source order, empty one skipped
    assert units == [document_unit(t) for t in texts]
    assert result.documents == len(texts) and result.tokens == sum(len(d) + 1 for d in decoded)
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    from looplm.artifacts import verify_manifest

    verify_manifest(out, [])  # the manifest has looplm.artifacts' layout: any checkpoint-style reader verifies it


def shard_cfg(cfg: DataConfig, out) -> DataConfig:
    return cfg.replace(source=f"shards:{out}")


@pytest.mark.parametrize("val_fraction,seq_len", [(0.2, 24), (0.0, 31), (0.01, 40)])  # 0.01: tiny-corpus fallback
def test_shard_source_yields_the_in_memory_windows(corpus, tmp_path, val_fraction, seq_len) -> None:
    out = tmp_path / "shards"
    tokenize(corpus, out)
    mem = DataConfig(source=str(corpus), seq_len=seq_len, val_fraction=val_fraction, val_batches=100)
    shards = shard_cfg(mem, out)
    packed = packed_corpus(mem, TOK)
    from looplm.data.shard_windows import shard_corpus

    sc = shard_corpus(shards, TOK)
    assert len(sc.train) == packed.train.shape[0] > 0 and len(sc.val) == packed.val.shape[0]
    assert torch.equal(sc.train[torch.arange(len(sc.train))], packed.train.long())
    assert torch.equal(sc.val[torch.arange(len(sc.val))], packed.val.long())
    assert (sc.train_documents, sc.val_documents, sc.train_tokens) == (
        packed.train_documents, packed.val_documents, packed.train_tokens)
    if val_fraction == 0.01:
        assert packed.val.shape[0] >= 1  # documents moved over by the fallback, the same ones
    for shuffle in (False, True):
        for world in (1, 2):
            for rank in range(world):
                a = TrainStream(mem.replace(shuffle=shuffle), TOK, batch_size=3, rank=rank, world_size=world)
                b = TrainStream(shards.replace(shuffle=shuffle), TOK, batch_size=3, rank=rank, world_size=world)
                assert a.windows_per_epoch == b.windows_per_epoch
                for _ in range(3 * a.windows_per_epoch // 3 + 2):  # a few epochs, crossing their ends
                    (x, y), (u, v) = next(a), next(b)
                    assert torch.equal(x, u) and torch.equal(y, v) and u.dtype == torch.int64
                va = validation_batches(mem, TOK, batch_size=2, rank=rank, world_size=world)
                vb = validation_batches(shards, TOK, batch_size=2, rank=rank, world_size=world)
                assert len(va) == len(vb) and all(torch.equal(p, q) for pa, pb in zip(va, vb) for p, q in zip(pa, pb))


def test_shard_stream_resumes_exactly_mid_epoch(corpus, tmp_path) -> None:
    out = tmp_path / "shards"
    tokenize(corpus, out)
    cfg = DataConfig(source=f"shards:{out}", seq_len=24, val_fraction=0.2)
    batch = TrainStream(cfg, TOK, batch_size=1).windows_per_epoch // 8 + 1  # 8 batches an epoch, the last partial
    for k in (0, 5, 13):
        stream = TrainStream(cfg, TOK, batch_size=batch)
        for _ in range(k):
            next(stream)
        state = json.loads(json.dumps(stream.state_dict()))
        expected = [next(stream) for _ in range(10)]
        resumed = TrainStream(cfg, TOK, batch_size=batch)
        resumed.load_state_dict(state)
        got = [next(resumed) for _ in range(10)]
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(expected, got))
    assert stream.epoch >= 2


def test_rerun_is_a_noop_and_an_interrupted_run_resumes(corpus, tmp_path) -> None:
    out = tmp_path / "shards"
    first = tokenize(corpus, out)
    before = mtimes(out)
    again = tokenize(corpus, out)
    assert again.up_to_date and mtimes(out) == before  # nothing rewritten
    manifest = (out / "manifest.json").read_text()

    # As if killed after some shards: no manifest, the last two shards missing or half-written.
    (out / "manifest.json").unlink()
    (out / "shard-00003.json").unlink()
    (out / "shard-00004.tokens.npy").write_bytes(b"partial")
    (out / ".tmp-shard-00005.tokens.npy-x").write_bytes(b"half")
    resumed = tokenize(corpus, out)
    assert resumed.written == 2 and resumed.kept == first.shards - 2
    after = mtimes(out)
    assert {n for n in before if after[n] != before[n]} == {
        f"shard-0000{k}.{a}" for k in (3, 4) for a in ("json", "tokens.npy", "offsets.npy", "units.npy")
    } | {"manifest.json"}
    assert (out / "manifest.json").read_text() == manifest  # the same shards as the uninterrupted run
    assert not list(out.glob(".tmp-*"))


def test_parallel_run_writes_the_same_shards(corpus, tmp_path) -> None:
    tokenize(corpus, tmp_path / "one")
    tokenize(corpus, tmp_path / "two", num_proc=2)
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert one["files"] == two["files"] and one["shards"] == two["shards"]


def test_tokenizer_mismatch_names_both(corpus, tmp_path, bpe_tokenizer_json) -> None:
    out = tmp_path / "shards"
    tokenize(corpus, out, str(bpe_tokenizer_json))
    cfg = DataConfig(source=f"shards:{out}", tokenizer="byte", seq_len=16)
    with pytest.raises(ConfigError, match="data.tokenizer='byte'") as err:
        TrainStream(cfg, TOK, batch_size=2)
    assert str(bpe_tokenizer_json) in str(err.value) and "vocab_size 257" in str(err.value)
    with pytest.raises(ConfigError, match="other settings .*tokenizer"):  # and tokenize refuses to mix jobs
        tokenize(corpus, out, "byte")


def test_damaged_shard_is_refused_then_rebuilt(corpus, tmp_path) -> None:
    out = tmp_path / "shards"
    tokenize(corpus, out)
    path = out / "shard-00001.tokens.npy"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    cfg = DataConfig(source=f"shards:{out}", seq_len=16)
    with pytest.raises(CheckpointError, match="shard-00001.tokens.npy has sha256"):
        TrainStream(cfg, TOK, batch_size=2)
    repaired = tokenize(corpus, out)
    assert repaired.written == 1
    TrainStream(cfg.replace(seed=1), TOK, batch_size=2)  # verifies again (another cache key) and opens


def test_shape_check_reads_no_bytes_but_catches_truncation(corpus, tmp_path) -> None:
    """data.shard_check=shape: the same windows as the checksum check; a flipped byte passes
    (that is what it gives up), a truncated or missing array is refused naming the file."""
    from looplm.data.shard_windows import shard_corpus

    out = tmp_path / "shards"
    tokenize(corpus, out)
    full = DataConfig(source=f"shards:{out}", seq_len=16, val_fraction=0.2)
    shape = full.replace(shard_check="shape")
    a, b = shard_corpus(full, TOK), shard_corpus(shape, TOK)
    assert torch.equal(a.train[torch.arange(len(a.train))], b.train[torch.arange(len(b.train))])
    path = out / "shard-00001.tokens.npy"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    TrainStream(shape.replace(seq_len=17), TOK, batch_size=2)  # opens: no checksum read (a new cache key)
    with pytest.raises(CheckpointError, match="shard-00001.tokens.npy has sha256"):
        TrainStream(full.replace(seq_len=17), TOK, batch_size=2)
    path.write_bytes(bytes(data[:-10]))  # truncated: the header says more than the file holds
    with pytest.raises(CheckpointError, match="shard-00001"):
        TrainStream(shape.replace(seq_len=18), TOK, batch_size=2)
    tokenize(corpus, out)  # rebuilt
    np.save(out / "shard-00000.units.npy", np.zeros(3))  # a well-formed file of the wrong length
    with pytest.raises(CheckpointError, match=r"shard-00000.units.npy holds float64\[3\], the manifest records"):
        TrainStream(shape.replace(seq_len=19), TOK, batch_size=2)
    (out / "shard-00000.offsets.npy").unlink()
    with pytest.raises(CheckpointError, match="shard-00000"):
        TrainStream(shape.replace(seq_len=20), TOK, batch_size=2)
    with pytest.raises(ConfigError, match="data.shard_check.*sha256 or shape"):
        DataConfig(source=f"shards:{out}", shard_check="none")


def test_shard_source_refusals(corpus, tmp_path) -> None:
    with pytest.raises(ConfigError, match="data.streaming"):
        DataConfig(source=f"shards:{tmp_path}", streaming=True)
    with pytest.raises(ConfigError, match="no such directory"):
        TrainStream(DataConfig(source=f"shards:{tmp_path / 'nope'}"), TOK, batch_size=1)
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        TrainStream(DataConfig(source=f"shards:{tmp_path}"), TOK, batch_size=1)
    out = tmp_path / "shards"
    tokenize(corpus, out)
    with pytest.raises(ConfigError, match="data.seq_len"):
        TrainStream(DataConfig(source=f"shards:{out}", seq_len=100_000), TOK, batch_size=1)
    with pytest.raises(ConfigError, match="SOURCE"):
        tokenize(f"shards:{out}", tmp_path / "again")
    with pytest.raises(ConfigError, match="no such path"):
        tokenize(tmp_path / "missing", tmp_path / "never")
    assert not (tmp_path / "never").exists()  # nothing created for a bad source
    with pytest.raises(ConfigError, match="data.text_field"):
        tokenize(corpus, tmp_path / "fixed", text_field="body")
    assert tokenize(corpus, tmp_path / "fixed").shards > 1  # a run that wrote no shard does not pin its settings


def test_cli_tokenize_then_train_from_shards_like_from_text(corpus, tmp_path, capsys) -> None:
    from looplm.cli import main

    out = tmp_path / "shards"
    assert main(["tokenize", str(corpus), str(out), "--shard-chars", "900", "--no-progress"]) == 0
    assert "data.source=shards:" in capsys.readouterr().out
    assert main(["tokenize", str(corpus), str(out), "--shard-chars", "900", "--no-progress"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert main(["tokenize", str(tmp_path / "missing"), str(tmp_path / "x"), "--no-progress"]) == 2
    assert os.path.isfile(out / "manifest.json")

    common = ["tiny-mesh", "model.d_model=32", "data.seq_len=16", "data.val_fraction=0.2", "train.batch_size=4",
              "train.max_steps=3", "train.eval_every=3", "train.log_every=1", "train.save_every=0", "train.sample_tokens=0"]
    losses = {}
    for name, source in (("text", str(corpus)), ("shards", f"shards:{out}"),
                         ("shape", f"shards:{out} data.shard_check=shape")):
        run = tmp_path / name
        assert main(["train", *common, *f"data.source={source}".split(), f"train.out_dir={run}", "--no-progress"]) == 0
        events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [(e.get("loss"), e.get("val_loss")) for e in events if "loss" in e or "val_loss" in e]
    assert losses["shards"] == losses["text"] == losses["shape"] and len(losses["text"]) >= 4  # same batches


def test_shard_check_is_resume_neutral(corpus, tmp_path, caplog) -> None:
    """Switching data.shard_check on resume reads the same tokens: no config-difference warning."""
    import logging

    from looplm.config import RunConfig
    from looplm.train import Trainer

    out = tmp_path / "shards"
    tokenize(corpus, out)

    def cfg(check):
        return RunConfig.from_dict({
            "model": {"layout": "1+1R2+1", "d_model": 32, "n_heads": 2, "vocab_size": 257},
            "data": {"source": f"shards:{out}", "seq_len": 16, "val_fraction": 0.2, "shard_check": check},
            "train": {"out_dir": str(tmp_path / "run"), "batch_size": 2, "max_steps": 4, "save_every": 2,
                      "eval_every": 0, "sample_tokens": 0}})

    Trainer(cfg("sha256"), progress=False).fit(stop_after=2)
    with caplog.at_level(logging.WARNING, logger="looplm"):
        trainer = Trainer(cfg("shape"), resume=True, progress=False)
    assert trainer.step == 2 and "differ" not in caplog.text


def test_hf_dataset_source_packs_alike_and_reruns_write_nothing(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    docs = make_documents(60, max_words=20)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs[:50]}),
                          "validation": datasets.Dataset.from_dict({"body": docs[50:]})}).save_to_disk(str(tmp_path / "dd"))
    source, out = f"hf:{tmp_path / 'dd'}", tmp_path / "shards"
    first = tokenize_to_shards(source, out, "byte", text_field="body", hf_split="validation", shard_chars=300)
    assert first.documents == 10 and first.shards > 1
    before = mtimes(out)
    again = tokenize_to_shards(source, out, "byte", text_field="body", hf_split="validation", shard_chars=300,
                               streaming=True)
    assert again.up_to_date and mtimes(out) == before  # re-read, streamed (same documents), nothing rewritten
    mem = DataConfig(source=source, text_field="body", hf_split="validation", seq_len=8, val_fraction=0.1)
    packed = packed_corpus(mem, TOK)
    from looplm.data.shard_windows import shard_corpus

    sc = shard_corpus(shard_cfg(mem, out), TOK)
    assert torch.equal(sc.train[torch.arange(len(sc.train))], packed.train.long())
    assert torch.equal(sc.val[torch.arange(len(sc.val))], packed.val.long())


def test_a_run_stopped_by_an_error_resumes_after_the_fix(tmp_path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    docs = make_documents(60, max_words=20)
    write_jsonl(folder / "a.jsonl", docs[:40])
    (folder / "b.jsonl").write_text(json.dumps({"text": docs[40]}) + "\n" + json.dumps({"txt": "typo"}) + "\n")
    out = tmp_path / "shards"
    with pytest.raises(ConfigError, match="data.text_field"):  # stops while reading b.jsonl
        tokenize(folder, out)
    assert not (out / "manifest.json").exists()
    done_before = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert len(done_before) >= 8  # a.jsonl's shards were written before the error
    write_jsonl(folder / "b.jsonl", docs[40:])
    resumed = tokenize(folder, out)
    assert resumed.kept == len(done_before) // 4 and resumed.written == resumed.shards - resumed.kept
    assert all(out.joinpath(n).stat().st_mtime_ns == t for n, t in done_before.items())  # kept, not rewritten
    fresh = tokenize(folder, tmp_path / "fresh")
    assert json.loads((out / "manifest.json").read_text())["files"] == json.loads(
        (tmp_path / "fresh" / "manifest.json").read_text())["files"]
