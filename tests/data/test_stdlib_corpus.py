"""The ``python-stdlib`` corpus (:mod:`looplm.data.stdlib`), the ``bpe:N`` tokenizer trained on
its training split (:mod:`looplm.data.bpe`) and its token shards, on a small fake standard
library (``LOOPLM_STDLIB_ROOT``); one test lists the real one."""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path

import pytest
import torch

from looplm.cli import main
from looplm.config_base import ConfigError
from looplm.data import DataConfig, TrainStream, build_tokenizer, data_tokenizer, validation_batches
from looplm.data import bpe
from looplm.data.packing import packed_corpus
from looplm.data.sources import iter_split_documents
from looplm.data.stdlib import STDLIB_ROOT_ENV, corpus_identity, path_unit, stdlib_files, stdlib_root
from looplm.data.tokenize_shards import tokenize_to_shards
from looplm.data.tokenizer import BPE_HOLDOUT

VOCAB = 300
NAMES = ["loop", "state", "core", "prelude", "coda", "token", "window", "batch", "epoch", "shard"]


def module_text(i: int) -> str:
    """A small, distinct Python module."""
    a, b = NAMES[i % len(NAMES)], NAMES[(3 * i + 1) % len(NAMES)]
    return (f'"""Module {i}: the {a} of the {b}."""\n\nimport os\n\n\n'
            f"def {a}_{i}(x, y={i}):\n    \"\"\"Return the {b} of x.\"\"\"\n    if x > y:\n"
            f"        return x - y  # {a} ü\n    return [{a!r} * k for k in range(x)]\n\n\n"
            f"class {b.title()}{i}:\n    size = {i * 7}\n")


def write_library(root: Path, modules: int = 60) -> Path:
    """A fake stdlib: modules in packages, plus what the corpus leaves out."""
    for i in range(modules):
        path = root / ("pkg" if i % 3 == 0 else "test" if i % 3 == 1 else ".") / f"mod_{i:02d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(module_text(i), encoding="utf-8")
    (root / "pkg" / "__init__.py").write_text("", encoding="utf-8")  # empty: no document
    (root / "latin1.py").write_bytes("# coding: latin-1\nx = 'caf\xe9'\n".encode("latin-1"))  # not UTF-8
    (root / "notes.txt").write_text("not python\n", encoding="utf-8")
    for skipped in ("site-packages/third_party.py", "__pycache__/cached.py", ".hidden/secret.py", "pkg/.dot.py"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("x = 1\n", encoding="utf-8")
    return root


@pytest.fixture
def library(tmp_path, monkeypatch) -> Path:
    root = write_library(tmp_path / "lib" / "python3.x")
    monkeypatch.setenv(STDLIB_ROOT_ENV, str(root))
    monkeypatch.setenv(bpe.CACHE_ENV, str(tmp_path / "cache"))
    return root


def stdlib_cfg(**kw) -> DataConfig:
    return DataConfig(source="python-stdlib", **{"seq_len": 32, "val_fraction": 0.1, **kw})


def test_files_are_the_python_sources_in_path_order(library) -> None:
    assert stdlib_root() == library
    relative = [rel for rel, _ in stdlib_files()]
    assert relative == sorted(relative) and len(relative) == 60 + 2  # + pkg/__init__.py, latin1.py (dropped on read)
    assert "pkg/__init__.py" in relative and "test/mod_01.py" in relative and "mod_02.py" in relative
    assert not [r for r in relative if "site-packages" in r or "__pycache__" in r or "/." in r or r.startswith(".")]
    docs = list(iter_split_documents(stdlib_cfg()))
    assert len(docs) == 60  # the empty and the non-UTF-8 file are left out
    assert [text for text, _ in docs] == [module_text(int(r[-5:-3])) for r in relative if "mod_" in r]


def test_split_is_by_path_hash_deterministic_and_disjoint(library, tmp_path, monkeypatch) -> None:
    cfg = stdlib_cfg(val_fraction=0.2)
    relative = [rel for rel, _ in stdlib_files() if "mod_" in rel]
    units = [unit for _, unit in iter_split_documents(cfg)]
    assert units == [path_unit(rel) for rel in relative]
    held = {rel for rel in relative if path_unit(rel) < 0.2}
    assert 0 < len(held) < len(relative)
    corpus = packed_corpus(cfg, build_tokenizer("byte"))
    assert corpus.val_documents == len(held) and corpus.train_documents == len(relative) - len(held)
    sides = ((corpus.val, [r for r in relative if r in held]), (corpus.train, [r for r in relative if r not in held]))
    for windows, side in sides:
        stream = [t for rel in side for t in [*(library / rel).read_bytes(), 256]]
        flat = windows.flatten().tolist()
        assert 0 < len(flat) and flat == stream[:len(flat)]  # each side holds its own files' bytes, in order

    # Same split from another root (another machine), and after a file's text changes.
    moved = tmp_path / "elsewhere"
    shutil.copytree(library, moved)
    first_held = next(iter(sorted(held)))
    (moved / first_held).write_text("# edited in a patch release\n" + module_text(999), encoding="utf-8")
    monkeypatch.setenv(STDLIB_ROOT_ENV, str(moved))
    assert [unit for _, unit in iter_split_documents(cfg)] == units


def test_corpus_identity_records_python_and_tells_corpora_apart(library, tmp_path) -> None:
    identity = corpus_identity()
    assert identity["python"] == platform.python_version() and identity["files"] == 60
    assert identity["corpus"] == "python-stdlib" and len(identity["fingerprint"]) == 32
    moved = tmp_path / "copy"
    shutil.copytree(library, moved)
    assert corpus_identity(moved)["fingerprint"] == identity["fingerprint"]  # paths relative to the root
    (moved / "pkg" / "new.py").write_text("y = 2\n", encoding="utf-8")
    assert corpus_identity(moved)["fingerprint"] != identity["fingerprint"]
    (library / "pkg" / "mod_00.py").write_text("changed = True\n", encoding="utf-8")
    assert corpus_identity()["fingerprint"] != identity["fingerprint"]


def test_bpe_trains_on_the_training_split_once_and_deterministically(library, tmp_path, monkeypatch) -> None:
    trained = []
    train = bpe.train_bpe
    monkeypatch.setattr(bpe, "train_bpe", lambda texts, n: trained.append(len(texts)) or train(texts, n))
    tok = data_tokenizer(stdlib_cfg(tokenizer=f"bpe:{VOCAB}"))
    assert tok.vocab_size == VOCAB and tok.eos_id == 0
    path = Path(tok.name)
    assert path.parent.parent == tmp_path / "cache" / "tokenizers" and path.parent.name.startswith(f"bpe-{VOCAB}-")
    training = [rel for rel, _ in stdlib_files() if "mod_" in rel and path_unit(rel) >= BPE_HOLDOUT]
    assert trained == [len(training)]
    meta = json.loads((path.parent / bpe.META_FILE).read_text())
    assert meta["documents"] == len(training) and meta["corpus"]["python"] == platform.python_version()

    # Cached: the same corpus and size load the file; any val_fraction <= BPE_HOLDOUT shares it.
    again = data_tokenizer(stdlib_cfg(tokenizer=f"bpe:{VOCAB}", val_fraction=0.05))
    assert again == tok and trained == [len(training)]
    # Deterministic: trained afresh in another cache, the same bytes.
    monkeypatch.setenv(bpe.CACHE_ENV, str(tmp_path / "other-cache"))
    fresh = data_tokenizer(stdlib_cfg(tokenizer=f"bpe:{VOCAB}"))
    assert len(trained) == 2 and Path(fresh.name).read_bytes() == path.read_bytes()
    # A changed corpus trains a new one.
    (library / "mod_05.py").write_text(module_text(5) + "extra = 1\n", encoding="utf-8")
    changed = data_tokenizer(stdlib_cfg(tokenizer=f"bpe:{VOCAB}"))
    assert len(trained) == 3 and changed.name != fresh.name

    text = module_text(123) + "emoji 🐍 and tabs\t\n"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text.encode("utf-8"))


def test_bpe_spec_errors(library) -> None:
    with pytest.raises(ConfigError, match=r"data.val_fraction.*at most 0.1 with a bpe:N tokenizer"):
        stdlib_cfg(tokenizer="bpe:8192", val_fraction=0.2)
    for spec in ("bpe:", "bpe:12", "bpe:8k"):
        with pytest.raises(ConfigError, match=r"'bpe:N' with N an integer >= 258"):
            data_tokenizer(stdlib_cfg(tokenizer=spec))
    with pytest.raises(ConfigError, match="build it with looplm.data.data_tokenizer"):
        build_tokenizer("bpe:8192")
    with pytest.raises(ConfigError, match="data.tokenizer"):
        DataConfig(source="task:copy", tokenizer="bpe:8192")


def test_shards_of_the_corpus_train_like_the_text(library, tmp_path, monkeypatch) -> None:
    out = tmp_path / "shards"
    result = tokenize_to_shards("python-stdlib", out, f"bpe:{VOCAB}", shard_chars=4000)
    assert result.shards > 1 and result.documents == 60
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"] == corpus_identity() and manifest["dtype"] == "uint16"
    assert tokenize_to_shards("python-stdlib", out, f"bpe:{VOCAB}", shard_chars=4000).up_to_date
    monkeypatch.setenv(bpe.CACHE_ENV, str(tmp_path / "another-cache"))  # the same tokenizer, trained again elsewhere
    assert tokenize_to_shards("python-stdlib", out, f"bpe:{VOCAB}", shard_chars=4000).up_to_date
    with pytest.raises(ConfigError, match="OUT.*other settings.*tokenizer"):
        tokenize_to_shards("python-stdlib", out, f"bpe:{VOCAB + 1}", shard_chars=4000)

    text_cfg = stdlib_cfg(tokenizer=f"bpe:{VOCAB}", val_fraction=0.1)
    shard_cfg = text_cfg.replace(source=f"shards:{out}")
    tok = data_tokenizer(shard_cfg)  # the corpus is found through the manifest
    assert tok == data_tokenizer(text_cfg)
    a, b = TrainStream(text_cfg, tok, 4), TrainStream(shard_cfg, tok, 4)
    assert a.windows_per_epoch == b.windows_per_epoch
    for _ in range(3):
        for x, y in zip(next(a), next(b)):
            assert torch.equal(x, y)
    for (xa, ya), (xb, yb) in zip(validation_batches(text_cfg, tok, 2), validation_batches(shard_cfg, tok, 2)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)

    # A file renamed with its text unchanged moves by its new path's hash: its shard is rewritten.
    (library / "mod_02.py").rename(library / "mod_02_renamed.py")
    assert not tokenize_to_shards("python-stdlib", out, f"bpe:{VOCAB}", shard_chars=4000).up_to_date


def test_cli_tokenize_then_train_from_shards_like_from_text(library, tmp_path, capsys) -> None:
    out = tmp_path / "s"
    assert main(["tokenize", "python-stdlib", str(out), "--tokenizer", f"bpe:{VOCAB}", "--no-progress"]) == 0
    assert f"data.tokenizer=bpe:{VOCAB}" in capsys.readouterr().out
    common = ["tiny-mesh", "model.d_model=32", f"model.vocab_size={VOCAB}", "data.seq_len=16",
              f"data.tokenizer=bpe:{VOCAB}", "train.batch_size=4",
              "train.max_steps=2", "train.eval_every=2", "train.log_every=1", "train.save_every=0",
              "train.sample_tokens=0"]
    losses = {}
    for name, source in (("text", "python-stdlib"), ("shards", f"shards:{out}")):
        run = tmp_path / name
        assert main(["train", *common, f"data.source={source}", f"train.out_dir={run}", "--no-progress"]) == 0
        events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [(e.get("loss"), e.get("val_loss")) for e in events if "loss" in e or "val_loss" in e]
    assert losses["shards"] == losses["text"] and len(losses["text"]) >= 3  # same batches, same vocabulary


def test_a_missing_library_is_a_config_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(STDLIB_ROOT_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=f"data.source.*python-stdlib.*set {STDLIB_ROOT_ENV}"):
        list(iter_split_documents(DataConfig(source="python-stdlib")))


def test_the_real_standard_library_lists_and_splits(monkeypatch) -> None:
    """The running interpreter's library: its files and their split, nothing read or trained."""
    monkeypatch.delenv(STDLIB_ROOT_ENV, raising=False)
    files = stdlib_files()
    relative = [rel for rel, _ in files]
    assert len(relative) > 500 and relative == sorted(relative)
    assert {"json/__init__.py", "os.py", "collections/__init__.py"} <= set(relative)
    assert not [r for r in relative if "site-packages" in r.split("/") or "dist-packages" in r.split("/")]
    held = [r for r in relative if path_unit(r) < 0.05]
    assert 0.02 * len(relative) < len(held) < 0.09 * len(relative)
    assert path_unit("json/__init__.py") == path_unit("json/__init__.py")  # no salted hash()


def test_data_identity_tells_another_machines_corpus_and_tokenizer(library) -> None:
    """A run's data identity (looplm.data.identity): the corpus's digest and the trained
    tokenizer's content; an edited library (another Python) changes both, and the
    differences name what changed. The byte tokenizer and a task's are the code's: no digest."""
    from looplm.data.identity import data_differences, data_identity

    cfg = DataConfig(source="python-stdlib", tokenizer=f"bpe:{VOCAB}", seq_len=32)
    first = data_identity(cfg, data_tokenizer(cfg))
    assert first == {"corpus": corpus_identity()["fingerprint"], "tokenizer": first["tokenizer"]}
    assert len(first["tokenizer"]) == 64 and data_identity(cfg, data_tokenizer(cfg)) == first  # stable
    edited = sorted(p for p in library.rglob("mod_*.py") if path_unit(str(p.relative_to(library))) >= BPE_HOLDOUT)[0]
    edited.write_text(edited.read_text(encoding="utf-8") + "\nEDITED = True\n", encoding="utf-8")
    second = data_identity(cfg, data_tokenizer(cfg))
    assert second["corpus"] != first["corpus"] and second["tokenizer"] != first["tokenizer"]
    assert [d.split(":")[0] for d in data_differences(first, second)] == ["the corpus", "the tokenizer"]
    assert data_differences(None, second) == [] and data_differences(first, None) == []  # unrecorded: unchecked
    assert data_differences(first, {"corpus": first["corpus"], "tokenizer": None}) == []  # unknown here
    byte = DataConfig(source="pydoc", tokenizer="byte", seq_len=32)
    assert data_identity(byte, data_tokenizer(byte)) == {"corpus": data_identity(byte, data_tokenizer(byte))["corpus"],
                                                         "tokenizer": None}
    task = DataConfig(source="task:addition", seq_len=64)
    assert data_identity(task, data_tokenizer(task)) is None
