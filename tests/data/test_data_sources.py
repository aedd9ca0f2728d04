"""Document sources: pydoc, local txt/jsonl/parquet files and folders, Hugging Face datasets."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_helpers import make_documents, write_jsonl
from looplm.config_base import ConfigError
from looplm.data import DataConfig, iter_documents


def docs_of(source, **fields) -> list[str]:
    return list(iter_documents(DataConfig(source=str(source), **fields)))


def write_parquet(path, docs, field="text"):
    pq.write_table(pa.table({field: docs, "n": list(range(len(docs)))}), str(path), row_group_size=7)
    return path


def test_pydoc_is_topics_in_key_order() -> None:
    from pydoc_data.topics import topics

    docs = docs_of("pydoc")
    assert docs == [topics[k] for k in sorted(topics)]
    assert len(docs) > 50 and sum(map(len, docs)) > 100_000


def test_txt_jsonl_parquet_files(tmp_path) -> None:
    docs = make_documents(30)
    (tmp_path / "a.txt").write_text("line one\n\nline two ü\n", encoding="utf-8")
    assert docs_of(tmp_path / "a.txt") == ["line one\n\nline two ü\n"]

    path = write_jsonl(tmp_path / "b.jsonl", docs)
    with path.open("a") as f:  # blank lines and null texts are skipped
        f.write("\n" + json.dumps({"text": None}) + "\n")
    assert docs_of(path) == docs

    assert docs_of(write_parquet(tmp_path / "c.parquet", docs)) == docs  # several row groups
    assert docs_of(write_jsonl(tmp_path / "d.jsonl", docs, field="content"), text_field="content") == docs


def test_folder_is_read_recursively_in_sorted_order(tmp_path) -> None:
    docs = make_documents(9)
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / ".hidden").mkdir()
    write_parquet(tmp_path / "sub" / "deeper" / "x.parquet", docs[6:])
    write_jsonl(tmp_path / "sub" / "b.jsonl", docs[1:6])
    (tmp_path / "a.txt").write_text(docs[0])
    (tmp_path / "README.md").write_text("skipped: not a corpus file")
    (tmp_path / ".hidden" / "z.txt").write_text("skipped: hidden")
    assert docs_of(tmp_path) == docs


def test_local_errors(tmp_path) -> None:
    with pytest.raises(ConfigError) as err:
        docs_of(tmp_path / "missing.jsonl")
    assert err.value.field == "data.source" and "no such path" in str(err.value)

    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(ConfigError, match="unknown file type '.csv'") as err:
        docs_of(tmp_path / "data.csv")
    assert err.value.field == "data.source"

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no"):
        docs_of(tmp_path / "empty")

    write_jsonl(tmp_path / "a.jsonl", ["x"], field="body")
    with pytest.raises(ConfigError) as err:
        docs_of(tmp_path / "a.jsonl")
    assert err.value.field == "data.text_field" and "body, n" in str(err.value)

    write_parquet(tmp_path / "p.parquet", ["x"], field="body")
    with pytest.raises(ConfigError, match="available: body, n") as err:
        docs_of(tmp_path / "p.parquet")
    assert err.value.field == "data.text_field"

    (tmp_path / "num.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ConfigError, match="holding strings"):
        docs_of(tmp_path / "num.jsonl")


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_saved_dataset(tmp_path, streaming) -> None:
    import datasets

    docs = make_documents(12)
    datasets.Dataset.from_dict({"text": docs, "n": list(range(12))}).save_to_disk(str(tmp_path / "ds"))
    assert docs_of(f"hf:{tmp_path / 'ds'}", streaming=streaming) == docs

    splits = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": docs[:5]}),
        "validation": datasets.Dataset.from_dict({"text": docs[5:]}),
    })
    splits.save_to_disk(str(tmp_path / "dd"))
    assert docs_of(f"hf:{tmp_path / 'dd'}", hf_split="validation", streaming=streaming) == docs[5:]
    with pytest.raises(ConfigError, match="train, validation") as err:
        docs_of(f"hf:{tmp_path / 'dd'}", hf_split="test", streaming=streaming)
    assert err.value.field == "data.hf_split"
    with pytest.raises(ConfigError, match="available: text, n") as err:
        docs_of(f"hf:{tmp_path / 'ds'}", text_field="content", streaming=streaming)
    assert err.value.field == "data.text_field"


def test_hf_local_data_folder_streaming(tmp_path) -> None:
    docs = make_documents(20)
    (tmp_path / "json").mkdir()
    write_jsonl(tmp_path / "json" / "part.jsonl", docs)
    assert docs_of(f"hf:{tmp_path / 'json'}", streaming=True) == docs


def test_hf_errors(tmp_path) -> None:
    with pytest.raises(ConfigError) as err:
        docs_of(f"hf:{tmp_path / 'missing'}")
    assert err.value.field == "data.source"
    with pytest.raises(ConfigError, match="'hf:' followed by"):
        docs_of("hf:")
