"""The ladder runner: every rung trained at one budget, tables and plots, reuse and resume, clear errors."""

from __future__ import annotations

import csv
import json
import shutil
import sys

import pytest

from looplm.cli import main
from looplm.config_base import ConfigError
from looplm.ladder import RUNGS, ladder_configs
from looplm.study import run_ladder
from looplm.study import ladder_study
from looplm.study import runs as runs_module
from looplm.train import Trainer, read_metrics, train_losses

# A CPU-second ladder: copy at L_train = 4 (10 tokens), evaluated at α = 1 and 2 on 2 problems.
TINY = (
    "model.d_model=16", "model.n_heads=2", "data.task.train_length=4", "data.seq_len=9",
    "data.task.eval_samples=2", "data.task.eval_alphas=[1, 2]", "data.val_batches=1", "train.batch_size=8",
    "train.eval_every=2", "train.save_every=0", "train.log_every=1", "train.sample_tokens=0", "train.device=cpu",
)
RUNG_SUBSET = ("dense", "ut_act", "ar_trm")  # untied, single-stream ACT, nested two-stream Q-halt
BUDGET, STEPS = 6, 4


def tiny_ladder(out_dir, **kw):
    return run_ladder("copy", BUDGET, out_dir, rungs=kw.pop("rungs", RUNG_SUBSET), steps=STEPS,
                      overrides=kw.pop("overrides", TINY), **kw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("ladder")
    return tiny_ladder(out)


def history(result, rung):
    return result.runs[rung][0].events("task_eval")


def test_ladder_writes_one_row_per_rung_and_alpha(trained) -> None:
    out = trained.out_dir
    with open(out / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["run"] for r in rows) == sorted(RUNG_SUBSET)
    rates = [f"{m}@{a}" for m in ("em", "char") for a in (1, 2)] + ["q1", "q2", "q3", "q4", "last"]
    for row in rows:
        assert int(row["steps"]) == STEPS and row["seed"] == "0"
        assert all(0.0 <= float(row[k]) <= 1.0 for k in rates if row[k])
        # the table is the run's own final task evaluation, not a recomputation
        metrics = read_metrics(out / row["run"] / "seed-0" / "metrics.jsonl")
        final = [e for e in metrics if e["event"] == "task_eval"][-1]
        assert final["step"] == STEPS and final["alphas"]["1"]["samples"] == 2
        for a in ("1", "2"):
            assert float(row[f"char@{a}"]) == pytest.approx(final["alphas"][a]["char_acc"])
    params = {r["run"]: int(r["parameters"]) for r in rows}
    assert params["dense"] > params["ut_act"]  # six untied blocks against one tied block
    with open(out / "results.csv", newline="") as f:
        summary = {(r["variant"], r["metric"]): r for r in csv.DictReader(f)}
    assert int(summary[("dense", "char@1")]["n"]) == 1  # one seed: a mean, no std
    assert summary[("dense", "char@1")]["std"] == ""

    markdown = (out / "results.md").read_text()
    assert "looplm ladder --task copy --budget 6" in markdown and "torch" in markdown
    for rung in RUNG_SUBSET:
        (line,) = [ln for ln in markdown.splitlines() if ln.startswith(f"| {rung} |")]
        assert f"| {BUDGET} |" in line
    for name in ("accuracy.png", "quartiles.png", "length.png", "last_char.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for rung in RUNG_SUBSET:  # evaluated every train.eval_every steps: a learning curve
        assert [e["step"] for e in history(trained, rung)] == [2, 4] and not trained.runs[rung][0].reused


def test_every_rung_spends_the_budget_on_one_shared_setup(tmp_path) -> None:
    for outer, inner in ((1, 2), (2, 1)):
        configs = ladder_configs("addition", 12, tmp_path, quick=True, outer=outer, inner=inner)
        assert list(configs) == list(RUNGS)
        assert {rung: cfg.model.block_passes for rung, cfg in configs.items()} == {rung: 12 for rung in RUNGS}
        shared = set()
        for rung, cfg in configs.items():
            d = cfg.to_dict()
            assert d["train"].pop("out_dir") == str(tmp_path / rung)
            for field in ("layout", "step_embeddings", "streams", "halting", "topology"):
                d["model"].pop(field)
            shared.add(json.dumps(d, sort_keys=True))
        assert len(shared) == 1  # width, heads, block, optimiser, data and seed: identical
    assert configs["ut_act"].model.halting.full_compute and configs["ar_trm"].model.halting.full_compute


def test_finished_rungs_are_reused_and_plots_are_optional(trained, tmp_path, monkeypatch, caplog) -> None:
    moved = tmp_path / "moved"  # a ladder directory moved elsewhere is still the same ladder
    shutil.copytree(trained.out_dir, moved)
    for png in moved.glob("*.png"):
        png.unlink()
    before = {r: (moved / r / "seed-0" / "metrics.jsonl").read_bytes() for r in RUNG_SUBSET}

    def no_training(*args, **kwargs):
        raise AssertionError("a finished rung was retrained")

    monkeypatch.setattr(runs_module, "Trainer", no_training)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if looplm[plot] were not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    ladder = tiny_ladder(moved)
    assert all(runs[0].reused for runs in ladder.runs.values())
    assert {r: (moved / r / "seed-0" / "metrics.jsonl").read_bytes() for r in RUNG_SUBSET} == before
    assert (moved / "results.csv").read_text() == (trained.out_dir / "results.csv").read_text()
    assert not list(moved.glob("*.png")) and "plots skipped: matplotlib is not installed" in caplog.text


def test_interrupted_rung_resumes_from_its_checkpoint(trained, tmp_path) -> None:
    study = ladder_study("copy", BUDGET, rungs=["dense"])
    (cfg,) = study.configs("default", tmp_path, 0, [f"train.max_steps={STEPS}", *TINY]).values()
    Trainer(cfg, progress=False).fit(stop_after=3)  # killed after step 3: a checkpoint and a partial summary
    result = tiny_ladder(tmp_path, rungs=["dense"])
    (rung,) = result.runs["dense"]
    events = read_metrics(tmp_path / "dense" / "seed-0" / "metrics.jsonl")
    assert not rung.reused and "resume" in [e["event"] for e in events]
    assert [e["step"] for e in history(result, "dense")] == [2, 3, 4]
    # resumed exactly: the same losses and final scores as the uninterrupted run
    uninterrupted = trained.runs["dense"][0]
    assert train_losses(rung.run_dir / "metrics.jsonl") == train_losses(uninterrupted.run_dir / "metrics.jsonl")
    assert history(result, "dense")[-1]["alphas"] == history(trained, "dense")[-1]["alphas"]


def test_a_run_of_other_settings_is_refused_before_training(trained, tmp_path) -> None:
    shutil.copytree(trained.out_dir, tmp_path / "ladder")
    with pytest.raises(ConfigError) as err:
        tiny_ladder(tmp_path / "ladder", overrides=(*TINY, "train.lr=1e-3"))
    assert err.value.field == "out_dir" and "train.lr" in str(err.value)


@pytest.mark.parametrize("kwargs, field, hint", [
    (dict(task="state_tracking"), "task", "copy, reverse, addition"),
    (dict(budget=0), "budget", ">= 1"),
    (dict(budget=10, rungs=["dense", "dual_nested_ut"]), "budget", "multiple of 3"),
    (dict(rungs=["dense", "deep"]), "rungs", "tied_step"),
    (dict(outer=0), "outer", ">= 1"),
    (dict(overrides=["model.layout=1R12"]), "model.layout", "each rung sets"),
    (dict(overrides=["model.halting.kind=act"]), "model.halting.kind", "each rung sets"),
    (dict(overrides=["train.out_dir=elsewhere"]), "train.out_dir", "--out"),
    (dict(overrides=["model.d_model=-1"]), "model.d_model", ""),
])
def test_bad_arguments_name_the_field(tmp_path, kwargs, field, hint) -> None:
    args = dict(task="copy", budget=12, out_dir=tmp_path, rungs=RUNGS)
    args.update(kwargs)
    with pytest.raises(ConfigError) as err:
        run_ladder(args.pop("task"), args.pop("budget"), args.pop("out_dir"), **args)
    assert err.value.field == field and hint in str(err.value)
    assert not any(tmp_path.iterdir())  # refused before anything trained


def test_cli_trains_and_prints_the_table(tmp_path, capsys, caplog) -> None:
    out = tmp_path / "cli"
    # overrides after --rungs are overrides, not rung names
    assert main(["ladder", "--task", "copy", "--budget", "2", "--steps", "2", "--out", str(out), "--no-progress",
                 "--rungs", "dense", *TINY]) == 0
    printed = capsys.readouterr().out
    (line,) = [ln for ln in printed.splitlines() if ln.startswith("| dense |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[7] == "2" and cells[-2] == "2"  # C and the steps trained
    assert f"{out}/results.md" in printed
    assert (out / "dense" / "seed-0" / "summary.json").is_file() and (out / "results.csv").is_file()
    assert "looplm ladder --task copy --budget 2 --out" in (out / "results.md").read_text()

    assert main(["ladder", "--task", "copy", "--budget", "5", "--rungs", "dual_ut", "--out", str(out)]) == 2
    assert "budget=5 is invalid: a multiple of 2" in caplog.text


def test_halting_tunables_reach_every_halting_rung_only(tmp_path) -> None:
    from looplm.ladder import ladder_configs

    configs = ladder_configs("copy", 12, tmp_path, overrides=["model.halting.init_bias=-3"])
    assert configs["ut_act"].model.halting.init_bias == -3.0
    assert configs["ar_trm"].model.halting.init_bias == -3.0
    assert configs["tied"].model.halting.init_bias is None and configs["tied"].model.halting.kind == "none"
    assert all(c.model.block_passes == 12 for c in configs.values())
    with pytest.raises(ConfigError) as err:
        ladder_configs("copy", 12, tmp_path, overrides=["model.halting.full_compute=false"])
    assert err.value.field == "model.halting.full_compute"
