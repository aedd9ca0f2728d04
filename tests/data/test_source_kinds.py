"""``data.source`` parsed once into typed kinds (:mod:`looplm.data.source_kinds`): every kind,
the round trip to the string, the errors, and the call sites reading the kind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import looplm
from looplm.config_base import ConfigError
from looplm.data import DataConfig
from looplm.data.source_kinds import (
    ALLOWED, BUILTIN_CORPORA, KINDS, BuiltinCorpus, HubDataset, TaskSource, TextPath, TokenShards, parse_source,
)
from looplm.tasks import is_task_source, task_name


@pytest.mark.parametrize("source, expected", [
    ("pydoc", BuiltinCorpus("pydoc")),
    ("python-stdlib", BuiltinCorpus("python-stdlib")),
    ("data/corpus.jsonl", TextPath("data/corpus.jsonl")),
    ("/abs/folder", TextPath("/abs/folder")),
    ("~/book.txt", TextPath("~/book.txt")),
    ("pydoc.txt", TextPath("pydoc.txt")),
    ("hf:roneneldan/TinyStories", HubDataset("roneneldan/TinyStories")),
    ("hf:./saved", HubDataset("./saved")),
    ("shards:/data/shards", TokenShards("/data/shards")),
    ("shards:hf:odd", TokenShards("hf:odd")),
    ("task:addition", TaskSource("addition")),
    ("task:state_tracking", TaskSource("state_tracking")),
])
def test_every_kind_parses_and_round_trips(source, expected) -> None:
    parsed = parse_source(source)
    assert parsed == expected and type(parsed) is type(expected)
    assert parsed.spec() == source
    assert parse_source(parsed.spec()) == parsed


@given(st.sampled_from(["", "hf:", "shards:", "task:", "pydoc", "python-stdlib", "./"]), st.text(max_size=12))
def test_any_source_round_trips_or_is_refused(head, tail) -> None:
    source = head + tail
    try:
        parsed = parse_source(source)
    except ConfigError:
        assert source in ("", "hf:", "shards:", "task:")
        return
    assert parsed.spec() == source and parse_source(parsed.spec()) == parsed
    assert isinstance(parsed, BuiltinCorpus) == (source in BUILTIN_CORPORA)


def test_kinds_are_distinct_and_say_what_they_hold() -> None:
    assert len({cls.kind for cls in KINDS}) == len(KINDS)
    assert [cls.kind for cls in KINDS if cls.holds_text] == ["builtin", "path", "hf"]
    for name in BUILTIN_CORPORA:
        assert name in ALLOWED
    for prefix in ("hf:NAME", "shards:DIR", "task:NAME"):
        assert prefix in ALLOWED


@pytest.mark.parametrize("source, message", [
    ("", "a non-empty string"),
    ("hf:", "'hf:' followed by a dataset name"),
    ("shards:", "'shards:' followed by a directory"),
    ("task:", "'task:' followed by a task name"),
])
def test_bad_sources_name_field_value_and_allowed(source, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_source(source)
    assert "data.source" in str(err.value)
    with pytest.raises(ConfigError, match=message):
        DataConfig(source=source)


def test_unknown_builtin_corpus_is_refused() -> None:
    with pytest.raises(ConfigError, match="a built-in corpus: pydoc, python-stdlib"):
        BuiltinCorpus("wikipedia")


def test_data_config_parses_once_and_keeps_the_string() -> None:
    cfg = DataConfig(source="shards:/tmp/x", shard_check="shape")
    assert cfg.parsed_source is cfg.parsed_source == TokenShards("/tmp/x")
    assert cfg.to_dict()["source"] == "shards:/tmp/x"
    assert DataConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="data.task.*null unless data.source is task:NAME"):
        DataConfig(source="pydoc", task={"train_length": 3})
    with pytest.raises(ConfigError, match="one of task:copy, task:reverse"):
        DataConfig(source="task:bogus")


def test_task_helpers_read_the_kind() -> None:
    assert task_name("task:copy") == "copy" and is_task_source("task:copy")
    assert task_name("shards:task:copy") is None and not is_task_source("pydoc")


def test_no_call_site_parses_a_source_prefix() -> None:
    """Only source_kinds.py knows the prefixes: no other module tests a string for them."""
    root = Path(looplm.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "source_kinds.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in ("task:", "shards:", "hf:"):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, offenders
