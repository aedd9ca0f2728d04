"""The papers' lm-eval suites (looplm.eval.suites): the definitions match the papers, the
table reproduces the papers' own rows and averages, and a suite of local test tasks runs
end to end from Python and the CLI (no network)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from looplm.eval.suites import SUITES, Column, Suite, markdown, suite_table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

NINE = ["LD-O", "LD-S", "HS", "PQ", "WG", "ARC-E", "ARC-C", "SciQ"]


def _spec(suite: Suite) -> list[tuple[str, tuple[str, ...], str]]:
    return [(c.header, c.tasks, c.metric) for c in suite.columns]


def test_suites_match_the_papers():
    """MeSH App. B / SpiralFormer App. F: acc_norm for PIQA, HellaSwag, ARC-E/C, SciQ; acc for
    LAMBADA, WinoGrande, cMMLU; 0 and 5 shots. SGT Table 1 and LT2 tab:downstream: accuracy, zero-shot."""
    pythia = [("LD-O", ("lambada_openai",), "acc"), ("LD-S", ("lambada_standard",), "acc"),
              ("HS", ("hellaswag",), "acc_norm"), ("PQ", ("piqa",), "acc_norm"), ("WG", ("winogrande",), "acc"),
              ("ARC-E", ("arc_easy",), "acc_norm"), ("ARC-C", ("arc_challenge",), "acc_norm"),
              ("SciQ", ("sciq",), "acc_norm")]
    assert _spec(SUITES["mesh"]) == pythia + [("cMMLU", ("mmlu_continuation",), "acc")]
    assert _spec(SUITES["spiralformer"]) == pythia + [("MMLU", ("mmlu_continuation",), "acc")]
    assert SUITES["mesh"].shots == SUITES["spiralformer"].shots == (0, 5)
    sgt = _spec(SUITES["sgt"])
    assert [h for h, _, _ in sgt] == ["ARC-E", "WG", "SIQA", "Hella.", "OBQA", "CSQA", "BA", "MMLU"]
    assert {m for _, _, m in sgt} == {"acc"} and SUITES["sgt"].shots == (0,)
    assert dict((h, t) for h, t, _ in sgt)["MMLU"] == ("mmlu_stem", "mmlu_social_sciences", "mmlu_humanities",
                                                       "mmlu_other")
    assert len(dict((h, t) for h, t, _ in sgt)["BA"]) == 10
    assert _spec(SUITES["lt2"]) == [(h, (t,), "acc") for h, t in [
        ("ARC-E", "arc_easy"), ("ARC-C", "arc_challenge"), ("HellaS.", "hellaswag"), ("PIQA", "piqa"),
        ("WG", "winogrande"), ("OBQA", "openbookqa"), ("SciQ", "sciq"), ("BoolQ", "boolq")]]
    assert SUITES["lt2"].shots == (0,)
    assert all(c.dataset for s in SUITES.values() for c in s.columns)


def test_suite_tasks_are_lm_eval_tasks():
    """Every task or group name is one lm-eval 0.4 defines (read from its task YAML files)."""
    lm_eval = pytest.importorskip("lm_eval")
    defined = set()
    for path in Path(lm_eval.__file__).parent.joinpath("tasks").rglob("*.yaml"):
        defined.update(re.findall(r"^(?:task|group): (\S+)\s*$", path.read_text(errors="replace"), flags=re.M))
    missing = {t for s in SUITES.values() for t in s.tasks} - defined
    assert not missing


def _results(values: dict[str, float], suite: Suite) -> dict:
    """lm-eval-shaped results where every task of a column scores the column's value."""
    results = {}
    for column in suite.columns:
        for task in column.tasks:
            results[task] = {f"{column.metric},none": values[column.header] / 100}
    return {"results": results}


@pytest.mark.parametrize("name,rows", [
    ("mesh", {0: ([32.31, 23.64, 31.14, 62.46, 50.59, 39.56, 23.21, 70.3, 25.69], 39.88),     # Table 2, Pythia-160M
              5: ([27.11, 24.22, 31.38, 62.95, 50.67, 42.21, 22.53, 78.2, 25.55], 40.54)}),
    ("spiralformer", {0: ([32.31, 23.64, 31.14, 62.46, 50.59, 39.56, 23.21, 70.30, 25.69], 39.88),  # Table 3
                      5: ([46.32, 45.29, 51.66, 70.51, 59.51, 60.61, 31.91, 93.20, 30.35], 54.37)}),
    ("sgt", {0: ([44.56, 49.57, 41.30, 30.89, 27.40, 29.24, 22.70, 24.80], 33.81)}),  # Table 1, Vanilla 275M
    ("lt2", {0: ([70.83, 37.54, 57.06, 72.43, 65.83, 38.6, 74.1, 57.83], 59.27)}),  # 1.3B Looped Transformer
])
def test_table_reproduces_the_papers_rows(name, rows):
    suite = SUITES[name]
    headers = [c.header for c in suite.columns]
    results = {shots: _results(dict(zip(headers, cells)), suite) for shots, (cells, _) in rows.items()}
    table = suite_table(suite, results)
    for row in table["rows"]:
        cells, avg = rows[row["shots"]]
        assert list(row["columns"].values()) == pytest.approx(cells)
        assert row["avg"] == pytest.approx(avg, abs=0.01)  # the papers round their cells
    lines = markdown(table).splitlines()
    assert lines[2] == "| Shot | " + " | ".join(headers) + " | Avg. |"
    first_cells, first_avg = rows[suite.shots[0]]
    assert lines[4].startswith(f"| {suite.shots[0]}-shot | {first_cells[0]:.2f} | {first_cells[1]:.2f} |")
    assert len(lines[4].split("|")) == len(headers) + 4


def test_group_results_are_read_from_groups():
    suite = Suite("g", "test", (0,), (Column("G", ("grp",), "acc", "local"),))
    table = suite_table(suite, {0: {"results": {}, "groups": {"grp": {"acc,none": 0.25}}}})
    assert table["rows"][0]["avg"] == 25.0


# ---------------------------------------------------------------- end to end (lm-eval, local tasks)
MC = [
    {"question": "Which is a colour?", "choices": ["red", "a table", "seventeen"], "label": 0},
    {"question": "What do cats say?", "choices": ["woof", "meow", "nothing at all, ever"], "label": 1},
    {"question": "Two plus two?", "choices": ["four", "five", "twenty-two", "4"], "label": 0},
    {"question": "Sky?", "choices": ["blue", "green"], "label": 0},
]


def _task(root: Path, name: str, data: Path) -> None:
    (root / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "fewshot_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: label\ndoc_to_choice: choices\n"
        "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n")


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    pytest.importorskip("lm_eval")
    import torch

    from looplm.model import LoopLM
    from tests.conftest import tiny_config
    from tests.eval.test_lm_eval import write_run

    root = tmp_path_factory.mktemp("suite")
    tasks = root / "tasks"
    tasks.mkdir()
    (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MC))
    (root / "mc_b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MC[::-1]))
    _task(tasks, "suite_mc", root / "mc.jsonl")
    _task(tasks, "suite_mc_b", root / "mc_b.jsonl")
    missing = root / "missing"
    missing.mkdir()
    _task(missing, "suite_gone", root / "not-there.jsonl")
    torch.manual_seed(0)
    run = write_run(root / "run", LoopLM(tiny_config("anchor", vocab_size=257, max_seq_len=64)).eval())
    suite = Suite("test", "a test-only suite over local tasks", (0, 1), (
        Column("MC", ("suite_mc",), "acc_norm", "local mc.jsonl"),
        Column("Both", ("suite_mc", "suite_mc_b"), "acc", "local mc.jsonl and mc_b.jsonl"),
    ))
    return {"tasks": tasks, "missing": missing, "run": run, "suite": suite}


def test_a_local_suite_runs_end_to_end(local):
    from looplm.eval.lm_eval import evaluate_suite, evaluate_tasks

    table, results = evaluate_suite(local["run"], local["suite"], include_path=local["tasks"], batch_size=3)
    assert set(results) == {0, 1}
    for row in table["rows"]:
        direct = evaluate_tasks(local["run"], ["suite_mc", "suite_mc_b"], num_fewshot=row["shots"],
                                include_path=local["tasks"])["results"]
        assert row["columns"]["MC"] == pytest.approx(100 * direct["suite_mc"]["acc_norm,none"])
        both = (direct["suite_mc"]["acc,none"] + direct["suite_mc_b"]["acc,none"]) / 2
        assert row["columns"]["Both"] == pytest.approx(100 * both)
        assert row["avg"] == pytest.approx((row["columns"]["MC"] + row["columns"]["Both"]) / 2)
        assert row["tasks"]["suite_mc_b"] == {"acc": direct["suite_mc_b"]["acc,none"]}
    assert results[1]["n-shot"]["suite_mc"] == 1 and results[0]["n-shot"]["suite_mc"] == 0


def test_the_cli_writes_the_suite_table(local, tmp_path, monkeypatch, capsys, caplog):
    from looplm.cli import main

    monkeypatch.setitem(SUITES, "test", local["suite"])
    out = tmp_path / "tables" / "test.json"
    args = ["lm-eval", str(local["run"]), "--suite", "test", "--include-path", str(local["tasks"])]
    assert main([*args, "--output", str(out)]) == 0
    table = json.loads(out.read_text())
    md = out.with_suffix(".md").read_text()
    assert md in capsys.readouterr().out
    assert "| Shot | MC | Both | Avg. |" in md and "| 0-shot |" in md and "| 1-shot |" in md
    assert [row["shots"] for row in table["rows"]] == [0, 1]
    assert main([*args, "--num-fewshot", "5"]) == 2 and "--num-fewshot does not apply to --suite test" in caplog.text
    with pytest.raises(SystemExit) as exit_:  # one or the other, refused by argparse
        main([*args, "--tasks", "suite_mc"])
    assert exit_.value.code == 2


def test_missing_data_names_the_dataset_and_how_to_provide_it(local, tmp_path, monkeypatch, caplog):
    from looplm.cli import main
    from looplm.eval.lm_eval import MissingData, evaluate_suite

    suite = Suite("gone", "test", (0,), (Column("G", ("suite_gone",), "acc", "someone/gone-dataset"),))
    with pytest.raises(MissingData, match=r"(?s)not available here: .*not-there.*HF_DATASETS_OFFLINE=1.*"
                       r"--include-path.*Suite gone reads G \(suite_gone\): someone/gone-dataset"):
        evaluate_suite(local["run"], suite, include_path=local["missing"])
    monkeypatch.setitem(SUITES, "gone", suite)
    assert main(["lm-eval", str(local["run"]), "--suite", "gone", "--include-path", str(local["missing"]),
                 "--output", str(tmp_path / "g.json")]) == 2
    assert "error: a task's dataset is not available here" in caplog.text and not (tmp_path / "g.json").exists()
