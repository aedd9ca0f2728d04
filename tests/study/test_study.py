"""The study runner: every study resolves at every size, --quick runs end to end with mean ± std
over 2 seeds, finished runs are reused and interrupted ones resumed exactly, bad input is named."""

from __future__ import annotations

import csv
import json
import math
import shutil

import pytest
import torch

from looplm.cli import main
from looplm.config import load_config
from looplm.config_base import ConfigError
from looplm.provenance import code_version
from looplm.study import RunSpec, Size, Study, get_study, run_study, study_names
from looplm.study import measures as study_measures
from looplm.study import runs as runs_module
from looplm.study.studies.common import QUICK
from looplm.train import Trainer, train_losses

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["mesh", "spiralformer", "sgt", "lt2", "ladder", "sharing", "depth"])
@pytest.mark.parametrize("size", ["quick", "default", "paper", "stdlib"])
def test_every_study_resolves_to_valid_configs(name, size, tmp_path) -> None:
    if size not in get_study(name, "quick").sizes:
        pytest.skip(f"study {name} has no {size} size")
    study = get_study(name, size)
    configs = study.configs(size, tmp_path, seed=5)
    rows = 3 if (name, size) == ("depth", "paper") else 4  # the paper size: Huginn's three rows only
    assert set(configs) == set(study.size(size).runs) and len(configs) >= rows
    for run, cfg in configs.items():
        assert cfg.train.out_dir == str(tmp_path / run / "seed-5")
        assert cfg.train.seed == 5 and cfg.data.seed == 5
    shared = {json.dumps({k: v for k, v in c.to_dict()["train"].items() if k != "out_dir"}, sort_keys=True)
              for run, c in configs.items() if not c.data.source.startswith("task:state")}
    assert len(shared) == 1  # one optimiser, budget and seed for every compared run
    if size == "default":
        assert study.size(size).seeds >= 3 and "min" in study.size(size).wall_time
    if size == "paper":
        assert study.size(size).wall_time
    if size == "stdlib":  # single epoch on the unrepeated corpus, each run's rate from a sweep
        from looplm.study.studies.common import STDLIB_BATCH, STDLIB_SEQ, STDLIB_STEPS

        spec = study.size(size)
        assert spec.sweep is not None and spec.max_seeds == 5 and spec.seeds == 3
        # every run is a language model on the corpus (lt2's state-tracking half stays at the default size)
        assert {c.data.source for c in configs.values()} == {"python-stdlib"} and len(configs) >= 4
        lm = configs
        assert all(c.train.max_steps * c.train.batch_size * c.data.seq_len <= 8_200_000 for c in lm.values())
        assert STDLIB_STEPS * STDLIB_BATCH * STDLIB_SEQ <= 8_200_000


def test_sharing_moe_rows_match_the_tied_core_in_flops_and_active_parameters() -> None:
    """The MoE rows' experts hold the dense FFN's width per token: the same FLOPs and (shared
    experts) active parameters as the tied core, up to the routers' d·E per block pass and the
    dense FFN's biases (h + d per block; experts have none)."""
    from looplm.accounting import active_parameter_count, count_flops

    configs = get_study("sharing").configs("default", "unused", 0)
    tied = configs["tied"].model
    d, passes, blocks = tied.d_model, tied.block_passes, 4
    for name in ("moe-shared", "moe-per-iteration", "moe-top1"):
        cfg = configs[name].model
        router = d * cfg.moe.experts
        assert cfg.layout == tied.layout == "1+2R3+1"
        assert count_flops(cfg, 128).forward == count_flops(tied, 128).forward + 2 * 128 * passes * router
        if not cfg.moe.per_iteration:
            biases = tied.ffn_hidden + d
            assert active_parameter_count(cfg) == active_parameter_count(tied) + blocks * (router - biases)


def test_matched_comparisons() -> None:
    """MeSH: the recursive variants share layout and block passes with each other and the vanilla
    model's depth; LT2: looped and non-looped differ only in the loop (same stored parameters)."""
    from looplm.accounting.params import analytic_parameter_counts

    mesh = get_study("mesh").configs("default", "unused", 0)
    assert {c.model.block_passes for c in mesh.values()} == {6}
    assert {c.model.layout for name, c in mesh.items() if name != "vanilla"} == {"1+2R2+1"}
    lt2 = get_study("lt2").configs("default", "unused", 0)
    for mixer in ("attention", "gdn", "full+gdn"):
        for part in ("lm", "state"):
            flat, looped = lt2[f"{mixer}/{part}"].model, lt2[f"{mixer}-looped/{part}"].model
            assert looped.block_passes == 2 * flat.block_passes
            # the learned per-loop residual gate adds a vector or two of width d, nothing else
            diff = analytic_parameter_counts(looped)["total"] - analytic_parameter_counts(flat)["total"]
            assert 0 < diff <= 2 * looped.iterations * looped.d_model


@pytest.mark.parametrize("size", ["quick", "default"])
def test_conversion_study_up_trains_every_loop_from_its_converted_start(size, tmp_path) -> None:
    """The dense run pretrains; each converted run has its own start (``<run dir>-converted``)
    and the same up-training budget and optimiser as the others."""
    study = get_study("conversion", size)
    configs = study.configs(size, tmp_path, seed=2)
    assert configs["dense"].model.layout == "6" and configs["dense"].train.init_from is None
    converted = {name: c for name, c in configs.items() if name != "dense"}
    assert {c.model.layout for c in converted.values()} == {"1+2R2+1"}
    assert {c.model.lora.rank for c in converted.values()} == {0, 16}
    for name, c in converted.items():
        assert c.train.init_from == str(tmp_path / name / "seed-2-converted")
    budgets = {json.dumps({k: v for k, v in c.to_dict()["train"].items() if k not in ("out_dir", "init_from")},
                          sort_keys=True) for c in converted.values()}
    assert len(budgets) == 1


def test_sharing_study_compares_the_tied_core_with_two_lora_ranks() -> None:
    configs = get_study("sharing").configs("default", "unused", 0)
    assert {c.model.layout for c in configs.values()} == {"1+2R3+1"}
    assert sorted(c.model.lora.rank for c in configs.values() if c.model.moe is None) == [0, 4, 16]
    assert all(c.model.lora.rank == 0 for c in configs.values() if c.model.moe is not None)  # the MoE block


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """Every study at its quick size over two seeds, but distillation: tests/study/
    test_distill_study.py trains and checks its own."""
    out = tmp_path_factory.mktemp("studies")
    return {name: run_study(name, out / name, size="quick", seeds=2, threads=1)
            for name in study_names() if name != "distill"}


@pytest.mark.parametrize("name", ["mesh", "spiralformer", "sgt", "lt2", "ladder", "sharing", "depth"])
def test_quick_study_writes_mean_and_std_over_two_seeds(quick, name) -> None:
    result = quick[name]
    out = result.out_dir
    with open(out / "results.csv", newline="") as f:
        summary = list(csv.DictReader(f))
    variants = result.study.variants("quick")
    assert {r["variant"] for r in summary} == set(variants)
    for row in summary:
        values = [float(v) for v in row["values"].split()]
        if len(values) == 2:  # defined at both seeds: the mean and sample std of those two
            assert float(row["mean"]) == pytest.approx(sum(values) / 2, rel=1e-5, abs=1e-12)
            assert float(row["std"]) == pytest.approx(abs(values[0] - values[1]) / 2 ** 0.5, rel=1e-4, abs=1e-9)
    with open(out / "runs.csv", newline="") as f:
        runs = list(csv.DictReader(f))
    assert sorted({(r["run"], r["seed"]) for r in runs}) == sorted(
        (run, str(s)) for run in result.study.size("quick").runs for s in (0, 1))
    markdown = (out / "results.md").read_text()
    assert f"looplm study {name} --out" in markdown and "--quick" in markdown and "--seeds 2" in markdown
    for v in variants:
        (line,) = [ln for ln in markdown.splitlines() if ln.startswith(f"| {v} |")]
        assert " ± " in line
    assert any(p.source.split(",")[0] in markdown for p in result.study.paper_columns) or not result.study.paper_columns
    header = next(ln for ln in markdown.splitlines() if ln.startswith("| variant |"))
    assert ("paper: " in header) == bool(result.study.paper_columns)
    for figure in result.study.figures:
        assert (out / figure.file).read_bytes()[:8] == PNG


@pytest.mark.parametrize("name", ["mesh", "spiralformer", "sgt", "lt2", "ladder", "sharing", "depth", "conversion"])
def test_series_csv_holds_every_runs_curves_point_by_point(quick, name) -> None:
    """series.csv is the figures' data: read back with the csv module, its rows are exactly
    the series each run's measure returned (run, seed, series, every (x, y) in order)."""
    result = quick[name]
    with open(result.out_dir / "series.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and set(rows[0]) == {"study", "run", "variant", "seed", "series", "x", "y"}
    got: dict[tuple, list] = {}
    for r in rows:
        assert r["study"] == name and r["variant"] == r["run"].split("/")[0]
        got.setdefault((r["run"], int(r["seed"]), r["series"]), []).append(
            [float(r["x"]), None if r["y"] == "" else float(r["y"])])
    want = {(run_name, run.seed, key): [[float(x), None if y is None else float(y)] for x, y in points]
            for run_name, runs in result.runs.items() for run, m in zip(runs, result.measures[run_name])
            for key, points in m["series"].items() if points}  # an empty series has no point to write
    assert got == want


def test_ladder_reports_where_its_halting_rungs_read_out(quick) -> None:
    """readout_depth (runs.csv) is the block passes behind the readout on held-out answers:
    ACT's Σ_τ w̄_τ·τ·passes per step from the halting_weight series (series.csv), Q-halt's
    terminal readout all C passes (full compute), blank without a halting rule."""
    result = quick["ladder"]
    runs = {(r["variant"], r["seed"]): r for r in csv.DictReader(open(result.out_dir / "runs.csv"))}
    series: dict[tuple, list] = {}
    for r in csv.DictReader(open(result.out_dir / "series.csv")):
        series.setdefault((r["variant"], r["seed"], r["series"]), []).append((float(r["x"]), float(r["y"])))
    for rung in ("dense", "tied", "tied_step"):
        assert runs[(rung, "0")]["readout_depth"] == ""
        assert not any(k[0] == rung and k[2] in ("halting_weight", "q_halt") for k in series)
    for rung in ("ut_act", "dual_ut", "dual_nested_ut"):
        model = result.runs[rung][0].config.model
        for seed in ("0", "1"):
            weights = series[(rung, seed, "halting_weight")]
            assert [t for t, _ in weights] == list(range(1, model.iterations + 1))
            assert sum(w for _, w in weights) == pytest.approx(1.0, rel=1e-5)  # ACT's weights sum to one
            depth = sum(w * t * model.passes_per_step for t, w in weights)
            assert float(runs[(rung, seed)]["readout_depth"]) == pytest.approx(depth, rel=1e-9)
            assert model.passes_per_step <= depth < model.block_passes  # UT's bias 1: shallower than C
    assert float(runs[("ar_trm", "0")]["readout_depth"]) == result.runs["ar_trm"][0].config.model.block_passes
    assert len(series[("ar_trm", "0", "q_halt")]) == result.runs["ar_trm"][0].config.model.iterations
    markdown = (result.out_dir / "results.md").read_text()
    header = next(ln for ln in markdown.splitlines() if ln.startswith("| variant |"))
    assert "halting bias" in header and "readout depth (passes)" in header
    assert "Readout depth: the block passes behind the readout" in markdown  # what the column measures


def test_ladder_bias_sweep_trains_every_act_rung_at_three_starting_biases(tmp_path) -> None:
    """``--size bias-sweep``: every ACT rung at its default bias, −1 and −3, otherwise the
    default size's run; its quick form trains in seconds and reads out deeper the lower the
    bias; the bias is the sweep's, not an override's."""
    from looplm.ladder import RUNGS
    from looplm.study.studies.ladder import ACT_RUNGS

    study = get_study("ladder", "bias-sweep")
    default = study.configs("default", tmp_path / "default", seed=1)
    act = [r for r in RUNGS if default[r].model.halting.kind == "act"]
    assert list(ACT_RUNGS) == act == ["ut_act", "dual_ut", "dual_nested_ut"]
    sweep = study.configs("bias-sweep", tmp_path / "sweep", seed=1)
    assert list(sweep) == [f"{r}{b}" for r in act for b in ("", "@bias-1", "@bias-3")]
    for name, cfg in sweep.items():
        rung = name.split("@")[0]
        assert cfg.model.halting.bias == {"": 1.0, "bias-1": -1.0, "bias-3": -3.0}[name[len(rung) + 1:]]
        assert cfg.train.out_dir == str(tmp_path / "sweep" / name / "seed-1")
        mine, theirs = cfg.to_dict(), default[rung].to_dict()
        for data in (mine, theirs):
            del data["train"]["out_dir"], data["model"]["halting"]["init_bias"]
        assert mine == theirs  # the default CPU size's run but for the starting bias
    same_dir = study.configs("bias-sweep", tmp_path / "default", seed=1)
    assert all(same_dir[r] == default[r] for r in act)  # given the default's --out, its runs are reused
    assert study.size("bias-sweep").seeds == 3 and "h" in study.size("bias-sweep").wall_time
    with pytest.raises(ConfigError) as err:
        study.configs("bias-sweep", tmp_path, seed=0, overrides=["model.halting.init_bias=-2"])
    assert err.value.field == "model.halting.init_bias" and "variants" in str(err.value)

    result = run_study("ladder", tmp_path / "quick", size="bias-sweep-quick", seeds=1, threads=1)
    depth = {v: result.scalars(v)[0]["readout_depth"] for v in result.variants}
    for rung in act:
        assert depth[rung] < depth[f"{rung}@bias-1"] < depth[f"{rung}@bias-3"]
    markdown = (tmp_path / "quick" / "results.md").read_text()
    assert "--size bias-sweep-quick" in markdown and "| ut_act@bias-3 |" in markdown


@pytest.mark.parametrize("name", ["mesh", "lt2"])
def test_paired_differences_by_seed(quick, name) -> None:
    """paired.csv and results.md compare the study's pairs (each row with its own baseline)
    seed by seed: the differences are runs.csv's values subtracted per seed, and the sign
    count follows the metric's direction."""
    result = quick[name]
    runs = list(csv.DictReader(open(result.out_dir / "runs.csv")))
    rows = list(csv.DictReader(open(result.out_dir / "paired.csv")))
    assert result.study.comparisons  # mesh: against base / anchor / vanilla; lt2: looped against once
    assert rows and {(r["variant"], r["reference"]) for r in rows} == set(result.study.comparisons)
    metrics = {m.key: m for m in result.study.metrics}
    for row in rows:
        key, ref = row["metric"], row["reference"]
        value = {(r["variant"], r["seed"]): r[key] for r in runs if r.get(key) not in (None, "")}
        expected = [float(value[row["variant"], s]) - float(value[ref, s]) for s in row["seeds"].split()]
        got = [float(d) for d in row["differences"].split()]
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-9)
        better = metrics[key].better
        assert better is not None  # a count without a direction (FLOPs, parameters) has no verdict
        sign = -1 if better == "lower" else 1
        assert int(row["wins"]) == sum(sign * d > 0 for d in got)
    markdown = (result.out_dir / "results.md").read_text()
    assert "Paired by seed, each row minus its reference" in markdown
    assert f"- trained by: looplm {code_version()} (" in markdown  # every run records its training code
    assert any(line.startswith(f"| {rows[0]['variant']} − {rows[0]['reference']} |") for line in markdown.splitlines())


def test_paired_verdicts_and_the_dirty_tree_mark() -> None:
    from looplm.study.definition import Metric
    from looplm.study.results import Paired, dirty_warning

    loss = Metric("val_loss", "loss", better="lower")
    clear = Paired("a", "b", loss, [0, 1, 2], [-0.10, -0.11, -0.09])
    assert clear.wins == 3 and not clear.undecided and clear.verdict() == "better in 3 of 3 seeds"
    mixed = Paired("a", "b", loss, [0, 1, 2], [-0.10, 0.08, -0.01])
    assert mixed.wins == 2 and mixed.undecided and mixed.verdict() == "better in 2 of 3 seeds (under 2 sd)"
    higher = Paired("a", "b", Metric("acc", "acc", better="higher"), [0, 1], [0.2, 0.3])
    assert higher.wins == 2
    assert Paired("a", "b", Metric("x", "x"), [0, 1, 2], [1.0, 2.0, 3.0]).verdict() == "3 seeds"
    assert dirty_warning({"looplm": "0.1.0 (git 1a3b28f)"}) is None
    assert "uncommitted changes (0.1.0 (git 1a3b28f-dirty))" in dirty_warning({"looplm": "0.1.0 (git 1a3b28f-dirty)"})


def test_study_specific_measures(quick) -> None:
    mesh = {(r["variant"], r["seed"]): r for r in csv.DictReader(open(quick["mesh"].out_dir / "runs.csv"))}
    assert mesh[("vanilla", "0")]["cka_loop"] == "" and float(mesh[("mesh", "0")]["cka_loop"]) > 0
    assert 0 < float(mesh[("base", "1")]["update_core"]) < 2  # 2‖f(h)−h‖/(‖f(h)‖+‖h‖) lies in [0, 2]
    sgt = {(r["variant"], r["seed"]): r for r in csv.DictReader(open(quick["sgt"].out_dir / "runs.csv"))}
    assert float(sgt[("vanilla", "0")]["flops_overhead"]) == 0.0
    assert float(sgt[("block-loop", "0")]["flops_overhead"]) > float(sgt[("sgt-k1", "0")]["flops_overhead"]) > 0
    assert "Growth decisions" in (quick["sgt"].out_dir / "results.md").read_text()
    lt2 = quick["lt2"]
    assert {"val_loss", "n_max"} <= set(lt2.scalars("gdn-looped")[0])  # the row merges its two parts
    # the attention sink (LT2 §4.4): a mass per loop for softmax attention, none for GDN; the gated pair ran
    for variant in ("attention-looped", "attention-looped-gated"):
        sink = lt2.scalars(variant)[0]
        assert 0.0 < sink["sink_first"] <= 1.0 and 0.0 < sink["sink_last"] <= 1.0
        assert [t for t, _ in lt2.series(variant, "sink_by_loop")[0]] == [0, 1]
    assert lt2.scalars("gdn-looped")[0]["sink_first"] is None
    ladder = {(r["variant"], r["seed"]): r for r in csv.DictReader(open(quick["ladder"].out_dir / "runs.csv"))}
    assert all(0.0 <= float(r["em_seen"]) <= 1.0 for r in ladder.values())  # held-out problems: seen reported apart
    spiral = {r["variant"]: r for r in csv.DictReader(open(quick["spiralformer"].out_dir / "runs.csv"))}
    assert float(spiral["SpiralFormer-B"]["forward_flops_per_token"]) < float(
        spiral["looped-T4-full-res"]["forward_flops_per_token"])


def test_depth_study_evaluates_the_fixed_loop_with_the_zero_shot_exits(quick) -> None:
    runs = {(r["variant"], r["seed"]): r for r in csv.DictReader(open(quick["depth"].out_dir / "runs.csv"))}
    row = runs[("fixed-T3", "0")]
    assert float(row["block_passes"]) == 8.0  # 1+2R3+1: the full loop
    for i in (1, 2):
        assert 0.0 <= float(row[f"exit{i}_saved"]) < 1.0 and math.isfinite(float(row[f"exit{i}_loss_paid"]))
    assert runs[("mor-expert", "0")]["exit1_saved"] == ""  # MoR's routers have parameters: no zero-shot exit
    assert "Δloss exit kl:5e-4" in (quick["depth"].out_dir / "results.md").read_text()


def test_conversion_study_starts_from_the_converted_dense_run(quick) -> None:
    """Each converted run's start is hf/convert.py's conversion of this seed's dense run."""
    from looplm.hf.convert import convert_model
    from looplm.model import LoopLM

    result = quick["conversion"]
    dense = LoopLM.from_pretrained(result.runs["dense"][0].run_dir)
    for name, init, rank in (("tied-stepwise", "stepwise", 0), ("lora-average", "average", 16)):
        start = LoopLM.from_pretrained(result.out_dir / name / "seed-0-converted")
        want, _, _ = convert_model(dense, "1+2R2+1", init, [("model.lora.rank", rank)])
        assert start.state_dict().keys() == want.state_dict().keys()
        assert all(torch.equal(v, want.state_dict()[k]) for k, v in start.state_dict().items())


def test_sgt_flops_follow_the_growth_events(quick) -> None:
    """Block Loop activates its layers at the first decision (step 1 of the quick size): step 1
    runs the plain model, steps 2 … 4 the grown one (SGT Tables 1-2 sum each step's FLOPs)."""
    from looplm.accounting.growth import training_flops_over_steps

    (run, _) = quick["sgt"].runs["block-loop"]
    cfg = run.config
    activated = [e for e in run.events_all("growth") if e["action"] == "activate"]
    assert {e["step"] for e in activated} == {1} and len(activated) == 3
    grown = training_flops_over_steps(cfg.model, cfg.data.seq_len, cfg.train.batch_size,
                                      [{e["layer"]: (1, None) for e in activated}], convention="sgt")
    base = study_measures._flops_per_step(run, "sgt")
    assert grown > base
    assert study_measures.grown_flops(run) == pytest.approx([0, base, base + grown, base + 2 * grown, base + 3 * grown])


# ------------------------------------------------------------------ resume
TINY = Study(
    name="tiny", title="tiny", paper="none", claim="none",
    sizes={"quick": Size({"a": RunSpec("tiny-base", ("model.layout=1R2",)),
                          "b": RunSpec("tiny-base", ("model.layout=2",))},
                         QUICK + ("data.seq_len=16", "train.save_every=1"), seeds=2)},
    metrics=(), measure=study_measures.lm,
)


def record_training(monkeypatch) -> list[tuple[str, bool]]:
    """(out_dir, resume) of every run a study trains from here on (the runs it reads back are
    not listed)."""
    trained = []
    real = runs_module.Trainer

    def recording(cfg, **kwargs):
        trained.append((cfg.train.out_dir, kwargs["resume"]))
        return real(cfg, **kwargs)

    monkeypatch.setattr(runs_module, "Trainer", recording)
    return trained


def test_resume_skips_finished_runs_and_continues_an_interrupted_one(tmp_path, monkeypatch) -> None:
    first = run_study(TINY, tmp_path / "full", size="quick")
    # interrupt run b at seed 1 after step 3: a checkpoint and a partial summary
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "b" / "seed-1")
    (cfg,) = [c for name, c in TINY.configs("quick", tmp_path / "cut", 1).items() if name == "b"]
    Trainer(cfg, progress=False).fit(stop_after=3)
    trained = record_training(monkeypatch)
    again = run_study(TINY, tmp_path / "cut", size="quick")
    assert trained == [(str(tmp_path / "cut" / "b" / "seed-1"), True)]  # the rest were read back
    assert [r.reused for r in again.runs["b"]] == [True, False] and all(r.reused for r in again.runs["a"])
    # resumed exactly: the same losses and validation loss as the uninterrupted run
    assert train_losses(again.runs["b"][1].run_dir / "metrics.jsonl") == train_losses(
        first.runs["b"][1].run_dir / "metrics.jsonl")
    assert again.measures["b"][1]["scalars"]["val_loss"] == first.measures["b"][1]["scalars"]["val_loss"]
    assert (tmp_path / "cut" / "results.csv").read_text() == (tmp_path / "full" / "results.csv").read_text()
    with pytest.raises(ConfigError) as err:  # the same directory with other settings is refused up front
        run_study(TINY, tmp_path / "cut", size="quick", overrides=["train.lr=1e-2"])
    assert err.value.field == "out_dir" and "train.lr" in str(err.value)


def test_reused_runs_are_measured_again_when_the_measure_code_changes(tmp_path, monkeypatch) -> None:
    import dataclasses

    from looplm.study import runner

    calls = []

    def counting(run):
        calls.append(run.run_dir)
        return study_measures.lm(run)

    study = dataclasses.replace(TINY, measure=counting)
    run_study(study, tmp_path, size="quick")
    assert len(calls) == 4
    run_study(study, tmp_path, size="quick")
    assert len(calls) == 4  # read back from each run's study.json
    stored = json.loads((tmp_path / "a" / "seed-0" / runner.MEASURES_FILE).read_text())
    assert stored["code"] == runner.measure_fingerprint(counting)
    monkeypatch.setattr(runner, "measure_fingerprint", lambda measure: "edited")
    run_study(study, tmp_path, size="quick")
    assert len(calls) == 8  # the measuring code changed: measured again


def test_records_without_checkpoints_are_read_back_and_refuse_a_new_measure(tmp_path, monkeypatch) -> None:
    """A finished study directory without its checkpoints (as committed under docs/results,
    whose .gitignore drops them) is read back whole on a fresh machine: nothing trains, the
    tables are the same. A run whose measures must be taken again says it has no model."""
    import dataclasses
    import subprocess
    from pathlib import Path

    from looplm.artifacts import CheckpointError
    from looplm.eval.load import load_run
    from looplm.study import runner

    def probing(run):  # reads the model, as the depth study's test-time curve does
        load_run(run.run_dir)
        return study_measures.lm(run)

    study = dataclasses.replace(TINY, measure=probing)
    run_study(study, tmp_path / "full", size="quick")
    shutil.copytree(tmp_path / "full", tmp_path / "records", ignore=shutil.ignore_patterns("checkpoints"))
    trained = []
    monkeypatch.setattr(runs_module, "Trainer", lambda cfg, **kwargs: trained.append(cfg))
    run_study(study, tmp_path / "records", size="quick")
    assert trained == []
    assert (tmp_path / "records" / "results.csv").read_text() == (tmp_path / "full" / "results.csv").read_text()
    monkeypatch.setattr(runner, "measure_fingerprint", lambda measure: "edited")
    with pytest.raises(CheckpointError, match="without its checkpoints") as err:
        run_study(study, tmp_path / "records", size="quick")
    assert "measures taken by other code" in str(err.value) and "delete" in str(err.value)
    repo = Path(__file__).resolve().parents[2]
    if (repo / ".git").exists():  # the repository commits a study's records, not its checkpoints
        checkpoint = "docs/results/depth-stdlib/fixed-T3/seed-0/checkpoints/step-400/model.safetensors"
        ignored = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", checkpoint], check=False)
        kept = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q",
                               "docs/results/depth-stdlib/fixed-T3/seed-0/metrics.jsonl"], check=False)
        assert (ignored.returncode, kept.returncode) == (0, 1)


def test_a_finished_run_never_measured_and_without_checkpoints_trains_again(tmp_path, monkeypatch) -> None:
    """A session that ends between a run's last step and its measures, on a machine that keeps
    untracked files but not ignored ones, leaves records without measures or checkpoints: the
    run trains again (the same losses), where a measured one is read back."""
    from looplm.study import runner

    first = run_study(TINY, tmp_path / "full", size="quick")
    shutil.copytree(tmp_path / "full", tmp_path / "cut", ignore=shutil.ignore_patterns("checkpoints"))
    (tmp_path / "cut" / "b" / "seed-1" / runner.MEASURES_FILE).unlink()
    trained = record_training(monkeypatch)
    again = run_study(TINY, tmp_path / "cut", size="quick")
    assert trained == [(str(tmp_path / "cut" / "b" / "seed-1"), False)]
    assert train_losses(again.runs["b"][1].run_dir / "metrics.jsonl") == train_losses(
        first.runs["b"][1].run_dir / "metrics.jsonl")
    assert (tmp_path / "cut" / "results.csv").read_text() == (tmp_path / "full" / "results.csv").read_text()


def test_a_finished_run_trained_on_other_data_is_refused(tmp_path) -> None:
    """A finished run whose sessions recorded other data than this machine's (its corpus, its
    tokenizer) is not read back into the table: a study is never mixed from two corpora."""
    run_study(TINY, tmp_path, size="quick")
    metrics = tmp_path / "b" / "seed-1" / "metrics.jsonl"
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    recorded = events[0]["data"]
    assert events[0]["event"] == "start" and recorded["corpus"]
    events[0]["data"] = {**recorded, "corpus": "f" * 32}
    metrics.write_text("".join(json.dumps(e) + "\n" for e in events))
    with pytest.raises(ConfigError) as err:
        run_study(TINY, tmp_path, size="quick")
    assert err.value.field == "data.source" and str(tmp_path / "b" / "seed-1") in str(err.value)
    assert f"the corpus: recorded {'f' * 32}, here {recorded['corpus']}" in str(err.value)


def test_variants_trains_and_tabulates_only_those(tmp_path) -> None:
    from looplm.study.results import INCOMPLETE

    result = run_study(TINY, tmp_path, size="quick", seeds=1, variants=["b"])
    assert list(result.runs) == ["b"] and not (tmp_path / "a").exists()
    table = (tmp_path / "results.md").read_text()
    assert "| b |" in table and "| a |" not in table and "--variants b" in table
    assert (tmp_path / INCOMPLETE).is_file()  # half a table: the claims do not read it
    run_study(TINY, tmp_path, size="quick", seeds=1)
    assert not (tmp_path / INCOMPLETE).exists()  # the whole study ran: its tables are final
    with pytest.raises(ConfigError) as err:
        run_study(TINY, tmp_path, size="quick", variants=["c"])
    assert err.value.field == "variants" and "a, b" in str(err.value)


def test_a_part_leaves_the_final_tables_of_the_whole_study_as_they_are(tmp_path, caplog) -> None:
    """A lane restarted after the whole table was written runs its part again (every run read
    back): the whole study's results and sweep tables stay as they are, and stay final."""
    import dataclasses
    import logging

    from looplm.study.definition import Sweep
    from looplm.study.results import INCOMPLETE
    from looplm.study.studies.common import VAL_LOSS

    quick = dataclasses.replace(TINY.sizes["quick"], seeds=1, sweep=Sweep((1e-3, 3e-2), ("train.max_steps=2",)))
    study = dataclasses.replace(TINY, sizes={"quick": quick}, metrics=(VAL_LOSS,))
    run_study(study, tmp_path, size="quick", variants=["b"])
    assert (tmp_path / INCOMPLETE).is_file()  # a part before the whole: its own half tables
    run_study(study, tmp_path, size="quick")
    tables = ("results.md", "results.csv", "runs.csv", "paired.csv", "series.csv", "lr-sweep.md", "lr-sweep.csv")
    whole = {name: (tmp_path / name).read_text() for name in tables}
    assert "| a |" in whole["results.md"] and "| a |" in whole["lr-sweep.md"]
    with caplog.at_level(logging.INFO, logger="looplm"):
        run_study(study, tmp_path, size="quick", variants=["b"])
    assert {name: (tmp_path / name).read_text() for name in tables} == whole
    assert not (tmp_path / INCOMPLETE).exists()
    assert "tables in" in caplog.text and "are final: this part (--variants b) left them as they are" in caplog.text


def test_deviations_say_when_overrides_changed_the_size(tmp_path) -> None:
    import dataclasses

    study = dataclasses.replace(TINY, deviations=("d = 32 (the paper: 768).",))
    run_study(study, tmp_path / "as-defined", size="quick", seeds=1, variants=["a"])
    plain = (tmp_path / "as-defined" / "results.md").read_text()
    assert "Deviations from the paper:\n\n- d = 32 (the paper: 768)." in plain
    run_study(study, tmp_path / "changed", size="quick", seeds=1, variants=["a"], overrides=["train.lr=1e-2"])
    changed = (tmp_path / "changed" / "results.md").read_text()
    assert "of the `quick` size as defined; this run changed it with `train.lr=1e-2`:" in changed
    assert "- d = 32 (the paper: 768)." in changed and "Deviations from the paper:\n" not in changed


def test_cli_variants_select_a_part_of_a_two_part_study(tmp_path, caplog) -> None:
    assert main(["study", "lt2", "--quick", "--seeds", "1", "--out", str(tmp_path), "--no-progress", "--variants",
                 "attention,attention-looped"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["attention", "attention-looped"]
    assert {p.name for p in (tmp_path / "attention").iterdir()} == {"lm", "state"}  # both parts of the variant
    assert main(["study", "lt2", "--quick", "--variants", "gdn,nope"]) == 2
    assert "variants=['gdn', 'nope'] is invalid" in caplog.text


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("kwargs, field, hint", [
    (dict(study="meshh"), "study", "mesh, spiralformer, sgt, lt2, depth, sharing, conversion, distill, ladder"),
    (dict(seeds=0), "seeds", ">= 1"),
    (dict(seeds=[1, 1]), "seeds", "distinct"),
    (dict(size="huge"), "size", "quick, default, stdlib, paper"),
    (dict(threads=0), "threads", ">= 1"),
    (dict(overrides=["model.topology.kind=mesh"]), "model.topology.kind", "variants"),
    (dict(overrides=["train.seed=3"]), "train.seed", "--seeds"),
    (dict(overrides=["model.d_model=-1"]), "model.d_model", ""),
])
def test_bad_arguments_name_the_field(tmp_path, kwargs, field, hint) -> None:
    args = dict(study="mesh", size="quick")
    args.update(kwargs)
    with pytest.raises(ConfigError) as err:
        run_study(args.pop("study"), tmp_path / "out", **args)
    assert err.value.field == field and hint in str(err.value)
    assert not (tmp_path / "out").exists()  # refused before anything trained


def test_cli(quick, tmp_path, capsys, caplog, monkeypatch) -> None:
    assert main(["study", "nope", "--quick", "--out", str(tmp_path)]) == 2
    assert "study='nope' is invalid" in caplog.text or "study=nope is invalid" in caplog.text
    assert main(["study", "mesh", "--quick", "--seeds", "0", "--out", str(tmp_path)]) == 2
    assert "seeds=0 is invalid" in caplog.text
    with pytest.raises(SystemExit):
        main(["study", "mesh", "--quick", "--paper"])
    assert not any(tmp_path.iterdir())

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was retrained")

    monkeypatch.setattr(runs_module, "Trainer", no_training)
    out = quick["ladder"].out_dir  # the same study again: every run is read back, the table printed
    assert main(["study", "ladder", "--quick", "--seeds", "2", "--threads", "1", "--no-progress",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("| variant | tie |") and f"{out}/results.md" in printed
    assert f"looplm study ladder --out {out} --quick --seeds 2 --threads 1" in (out / "results.md").read_text()


def test_a_sweep_picks_each_runs_learning_rate_and_seeds_extend_while_undecided(tmp_path, monkeypatch) -> None:
    """A size's learning-rate sweep trains every run at seed 0 at each rate, records the
    table, and the seeds train at each run's best rate; with max_seeds, seeds are added while
    the primary metric's paired difference is under two standard deviations."""
    import dataclasses

    from looplm.study import runner
    from looplm.study.definition import Metric, Sweep
    from looplm.study.studies.common import VAL_LOSS

    quick = dataclasses.replace(TINY.sizes["quick"], seeds=2, max_seeds=3,
                                sweep=Sweep((1e-3, 3e-2), ("train.max_steps=2",)), notes=("a size note",))
    study = dataclasses.replace(TINY, sizes={"quick": quick}, metrics=(VAL_LOSS,))
    verdicts = iter([{"a", "b"}])  # after seeds 0, 1: b − a undecided; after seed 2: max_seeds reached anyway
    monkeypatch.setattr(runner, "undecided_variants", lambda result: next(verdicts))
    result = run_study(study, tmp_path, size="quick")
    sweep = list(csv.DictReader(open(tmp_path / "lr-sweep.csv")))
    assert {(r["run"], float(r["lr"])) for r in sweep} == {(n, lr) for n in ("a", "b") for lr in (1e-3, 3e-2)}
    for name in ("a", "b"):
        rows = [r for r in sweep if r["run"] == name]
        best = min(rows, key=lambda r: float(r["value"]))
        assert [r["chosen"] for r in rows].count("True") == 1 and best["chosen"] == "True"
        assert all(run.config.train.lr == float(best["lr"]) for run in result.runs[name])
        assert (tmp_path / "lr-sweep" / f"lr-{float(best['lr']):g}" / name / "seed-0" / "summary.json").is_file()
    assert result.seeds == [0, 1, 2] and len(result.runs["a"]) == 3
    assert "**" in (tmp_path / "lr-sweep.md").read_text()
    # results.md names each row's rate where the sweep chose different ones
    rates = {name: result.runs[name][0].config.train.lr for name in ("a", "b")}
    markdown = (tmp_path / "results.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| variant"))
    assert ("| lr |" in header) == (rates["a"] != rates["b"]) == ("lr per row" in markdown)
    assert "Size `quick`:\n\n- a size note\n" in markdown
    # rerun: the sweep and the seeds are read back, nothing trains
    monkeypatch.setattr(runner, "undecided_variants", lambda result: set())
    trained = []
    monkeypatch.setattr(runs_module, "Trainer", lambda *a, **k: trained.append(a) or pytest.fail("trained again"))
    again = run_study(study, tmp_path, size="quick", seeds=[0, 1, 2])
    assert not trained and again.seeds == [0, 1, 2]
    with pytest.raises(ConfigError, match="sweep.lrs"):
        Sweep((1e-3,))
    with pytest.raises(ConfigError, match="size.max_seeds"):
        dataclasses.replace(quick, max_seeds=1)
    assert Metric("x", "x").better is None and study.primary is VAL_LOSS
def test_a_sweep_reads_the_final_validation_loss_without_the_studys_measure(tmp_path) -> None:
    """A sweep on the validation loss reads each run's last eval record: the study's measure
    (probes, test-time curves: minutes per run) runs for the seed runs only; a sweep on
    another metric measures."""
    import dataclasses

    from looplm.study.definition import Metric, Sweep
    from looplm.study.studies.common import VAL_LOSS

    measured = []

    def measure(run):
        measured.append(run.run_dir)
        return {**study_measures.lm(run), "scalars": {**study_measures.lm(run)["scalars"], "score": 1.0}}

    quick = dataclasses.replace(TINY.sizes["quick"], seeds=1, sweep=Sweep((1e-3, 3e-2), ("train.max_steps=2",)))
    study = dataclasses.replace(TINY, sizes={"quick": quick}, metrics=(VAL_LOSS,), measure=measure)
    run_study(study, tmp_path / "loss", size="quick")
    assert measured and all("lr-sweep" not in str(path) for path in measured)
    for row in csv.DictReader(open(tmp_path / "loss" / "lr-sweep.csv")):
        summary = json.loads((tmp_path / "loss" / "lr-sweep" / f"lr-{float(row['lr']):g}" / row["run"] / "seed-0"
                              / "summary.json").read_text())
        assert float(row["value"]) == pytest.approx(summary["val_loss"])
    measured.clear()
    scored = dataclasses.replace(study, metrics=(Metric("score", "score", better="higher"), VAL_LOSS))
    run_study(scored, tmp_path / "score", size="quick")
    assert sum("lr-sweep" in str(path) for path in measured) == 4


def test_an_added_seed_trains_only_the_undecided_rows_and_the_reference(tmp_path, monkeypatch) -> None:
    """Seeds past the size's own train the rows whose paired difference is under two sd and the
    reference, not the decided rows; the table counts each row's seeds and pairs on shared ones.
    A study with a ``prepare`` hook (a run may start from another row's run) adds every row."""
    import dataclasses

    from looplm.study import runner
    from looplm.study.studies.common import VAL_LOSS

    three = dataclasses.replace(TINY.sizes["quick"], runs={**TINY.sizes["quick"].runs,
                                                          "c": RunSpec("tiny-base", ("model.layout=1R3",))},
                                seeds=2, max_seeds=4)
    study = dataclasses.replace(TINY, sizes={"quick": three}, metrics=(VAL_LOSS,))
    asked = []

    def undecided(result):
        asked.append(list(result.seeds))
        return {"a", "b"} if len(result.seeds) < 4 else set()  # b against the reference a

    monkeypatch.setattr(runner, "undecided_variants", undecided)
    result = run_study(study, tmp_path, size="quick")
    assert asked == [[0, 1], [0, 1, 2]] and result.seeds == [0, 1, 2, 3]  # asked until max_seeds
    assert {name: [r.seed for r in runs] for name, runs in result.runs.items()} == {
        "a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1]}
    assert not (tmp_path / "c" / "seed-2").exists() and (tmp_path / "b" / "seed-3" / "summary.json").is_file()
    assert [result.row_seeds(v) for v in "abc"] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1]]
    assert len(result.values("c", "val_loss")) == 2 and len(result.values("b", "val_loss")) == 4
    pairs = {p.variant: p.seeds for p in runner.paired(result)}
    assert pairs == {"b": [0, 1, 2, 3], "c": [0, 1]}
    markdown = (tmp_path / "results.md").read_text()
    assert "over the row's seeds (column `seeds`: seeds past the first 2" in markdown
    header, _, a_row, b_row, c_row = [line for line in markdown.splitlines() if line.startswith("| ")][:5]
    seeds_at = header.split(" | ").index("seeds")
    assert [row.split(" | ")[seeds_at] for row in (a_row, b_row, c_row)] == ["4", "4", "2"]
    assert "(n=" not in c_row  # two of two seeds, not two of four
    runs_csv = list(csv.DictReader(open(tmp_path / "runs.csv")))
    assert sorted((r["variant"], r["seed"]) for r in runs_csv if r["variant"] == "c") == [("c", "0"), ("c", "1")]
    # a study whose runs are prepared from other rows' runs extends every row
    prepared = dataclasses.replace(study, prepare=lambda name, cfg: None)
    monkeypatch.setattr(runner, "undecided_variants", lambda result: {"b"} if len(result.seeds) < 3 else set())
    again = run_study(prepared, tmp_path / "prepared", size="quick")
    assert {name: [r.seed for r in runs] for name, runs in again.runs.items()} == {
        "a": [0, 1, 2], "b": [0, 1, 2], "c": [0, 1, 2]}


def test_comparisons_pair_each_row_with_its_own_baseline_and_decide_the_extension(tmp_path, monkeypatch) -> None:
    """A study's ``comparisons`` replace "every row against the reference" in the paired table
    and paired.csv; an undecided comparison extends both its rows (not the study's reference);
    a pair naming an unknown row is refused."""
    import dataclasses

    from looplm.study import runner
    from looplm.study.results import Paired, paired
    from looplm.study.studies.common import VAL_LOSS

    size = dataclasses.replace(TINY.sizes["quick"], runs={**TINY.sizes["quick"].runs,
                                                          "c": RunSpec("tiny-base", ("model.layout=1R3",))})
    study = dataclasses.replace(TINY, sizes={"quick": size}, metrics=(VAL_LOSS,), comparisons=(("c", "b"),))
    result = run_study(study, tmp_path, size="quick")
    assert [(p.variant, p.reference) for p in paired(result)] == [("c", "b")]
    rows = list(csv.DictReader(open(tmp_path / "paired.csv")))
    assert [(r["variant"], r["reference"]) for r in rows] == [("c", "b")]
    assert "each row minus its reference" in (tmp_path / "results.md").read_text()
    undecided = Paired("c", "b", VAL_LOSS, [0, 1], [0.1, -0.1])
    monkeypatch.setattr(runner, "paired", lambda result: [undecided, dataclasses.replace(undecided, variant="x",
                                                                                           differences=[0.1, 0.1])])
    assert runner.undecided_variants(result) == {"b", "c"}  # x − b is settled: x is not extended
    with pytest.raises(ConfigError, match="study.comparisons"):
        dataclasses.replace(study, comparisons=(("c", "nope"),))
    with pytest.raises(ConfigError, match="study.comparisons"):
        dataclasses.replace(study, comparisons=(("c", "c"),))


def test_depth_study_pairs_each_family_with_its_baselines(quick) -> None:
    """MoR against the loop it is cut from and the matched-compute fixed loop; Huginn's rows
    against their matched-FLOPs fixed loop, never against the other family's."""
    pairs = {(r["variant"], r["reference"]) for r in csv.DictReader(open(quick["depth"].out_dir / "paired.csv"))}
    assert ("mor-expert", "fixed-T3") in pairs and ("mor-expert", "fixed-T2") in pairs
    assert ("huginn-r2-k1", "huginn-fixed-T2") in pairs and ("huginn-fixed-T2-k1", "huginn-fixed-T2") in pairs
    assert not any(v.startswith("huginn") != r.startswith("huginn") for v, r in pairs)


def test_a_sweep_tries_past_its_edge_while_the_best_rate_sits_on_it(tmp_path) -> None:
    """Sweep.extend: a run whose best rate is the lowest (highest) it has tried also tries half
    (twice) that rate, at most ``extend`` times; an interior best stops it; a diverged
    (unmeasured) rate counts as tried. The table lists every rate any run tried."""
    import dataclasses

    from looplm.study.definition import Sweep
    from looplm.study.studies.common import VAL_LOSS
    from looplm.study.sweep import reachable_rates, run_lr_sweep, sweep_configs

    size = dataclasses.replace(TINY.sizes["quick"], runs={**TINY.sizes["quick"].runs,
                                                          "c": RunSpec("tiny-base", ("model.layout=1",))},
                               sweep=Sweep((2e-3, 4e-3, 8e-3), extend=2))
    study = dataclasses.replace(TINY, sizes={"quick": size}, metrics=(VAL_LOSS,))
    # val loss by rate: a keeps improving downward, b is best inside, c diverges above 8e-3 and
    # is best at 8e-3 once 1.6e-2 failed
    curves = {"a": lambda lr: lr, "b": lambda lr: abs(lr - 4.1e-3), "c": lambda lr: float("nan") if lr > 9e-3 else -lr}
    trained = []

    def train(name, seed, cfg):
        trained.append((name, cfg.train.lr))
        assert seed == 0 and f"lr-{cfg.train.lr:g}" in cfg.train.out_dir
        return name, cfg.train.lr

    def measure(run):
        name, lr = run
        return {"scalars": {VAL_LOSS.key: curves[name](lr)}}

    chosen = run_lr_sweep(study, "quick", tmp_path, [], ["a", "b", "c"], train, measure)
    assert chosen == {"a": 5e-4, "b": 4e-3, "c": 8e-3}
    assert sorted(lr for name, lr in trained if name == "a") == [5e-4, 1e-3, 2e-3, 4e-3, 8e-3]  # two past the edge
    assert sorted(lr for name, lr in trained if name == "b") == [2e-3, 4e-3, 8e-3]
    assert sorted(lr for name, lr in trained if name == "c") == [2e-3, 4e-3, 8e-3, 1.6e-2]  # diverged: stops
    table = (tmp_path / "lr-sweep.md").read_text()
    assert "| lr 0.0005 | lr 0.001 | lr 0.002 |" in table and "| b | – | – |" in table
    assert {(r["run"], float(r["lr"])) for r in csv.DictReader(open(tmp_path / "lr-sweep.csv"))} == set(trained)
    # what the queue's link test reads: the rates a sweep may reach, and its configs at one
    assert {lr for _, lr in trained} | {3.2e-2} == reachable_rates(size.sweep)
    configs = sweep_configs(study, "quick", tmp_path, [], 5e-4)
    assert configs["a"].train.lr == 5e-4 and configs["a"].train.out_dir == str(tmp_path / "lr-sweep" / "lr-0.0005" / "a" / "seed-0")
    with pytest.raises(ConfigError, match="sweep.extend"):
        Sweep((1e-3, 2e-3), extend=-1)


def test_depth_study_compares_huginn_with_fixed_depth_at_matched_training_flops(tmp_path) -> None:
    """The Huginn block of the depth study: every size resolves, and its fixed-depth
    baseline's training FLOPs equal the expected FLOPs of the drawn counts (within 1 %)."""
    import collections

    from looplm.accounting import count_flops

    for size in ("quick", "default", "paper"):
        configs = get_study("depth", size).configs(size, tmp_path, seed=5)
        assert {"huginn-fixed-T4-k2", "huginn-r4-k2", "huginn-fixed-T3"} <= set(configs) or size != "default"
    configs = get_study("depth", "default").configs("default", tmp_path, seed=5)
    huginn, fixed = configs["huginn-r4-k2"].model, configs["huginn-fixed-T3"].model
    seq = configs["huginn-fixed-T3"].data.seq_len
    counts = collections.Counter(huginn.depth.count(huginn.iterations, 0, step) for step in range(4000))
    expected = sum(n * count_flops(huginn, seq, iterations=r).training for r, n in counts.items()) / 4000
    assert count_flops(fixed, seq).training == pytest.approx(expected, rel=0.01)


def test_depth_study_measures_drawn_counts_and_the_test_time_curve(quick) -> None:
    from looplm.accounting import count_flops

    result = quick["depth"]
    (run, _) = result.runs["huginn-r2-k1"]
    cfg = run.config
    steps = [cfg.model.depth.count(cfg.model.iterations, cfg.train.seed, s) for s in range(cfg.train.max_steps)]
    want = sum(count_flops(cfg.model, cfg.data.seq_len, batch=cfg.train.batch_size, iterations=r).training
               for r in steps)
    scalars, curve = result.scalars("huginn-r2-k1")[0], result.series("huginn-r2-k1", "loss_vs_iterations")[0]
    assert scalars["train_flops"] == pytest.approx(want)
    assert [r for r, _ in curve] == list(range(1, 4 * cfg.model.iterations + 1))
    assert scalars["val_loss_at_max"] == curve[-1][1]
    for row in ("huginn-r2-k1", "huginn-fixed-T2", "fixed-T3", "mor-expert"):  # on the batches training validated on
        trained = result.runs[row][0].config.model.iterations
        for scalars, curve in zip(result.scalars(row).values(), result.series(row, "loss_vs_iterations")):
            assert curve[trained - 1][1] == pytest.approx(scalars["val_loss"], rel=1e-5), row


def test_test_time_curve_is_none_for_a_model_that_runs_only_its_trained_count(tmp_path) -> None:
    for name, override in (("dense", "model.layout=3"), ("mesh", "model.topology={kind: mesh}")):
        cfg = load_config("tiny-base", [*QUICK, "data.seq_len=16", f"train.out_dir={tmp_path / name}", override])
        Trainer(cfg, progress=False).fit()
        run = runs_module.Run(name=name, seed=0, run_dir=tmp_path / name, config=cfg, summary={}, reused=False)
        assert study_measures.test_time_curve(run) == {"scalars": {"val_loss_at_max": None}, "series": {},
                                                       "notes": []}


def test_stdlib_sizes_compute_the_loss_without_logits_except_those_already_trained(tmp_path) -> None:
    """Studies started after ``train.loss_rows`` existed train with it (and say so); depth and
    sharing keep the logits their recorded runs trained with (so they are read back, not
    retrained), as does distillation, whose KD loss reads the logits."""
    from looplm.study.studies.common import LOSS_ROWS_NOTE, STDLIB_LOSS_ROWS

    sizes = {name: "stdlib" for name in ("mesh", "spiralformer", "sgt", "lt2", "depth", "sharing")}
    for name, size_name in {**sizes, "distill": "default"}.items():
        study = get_study(name)
        size = study.size(size_name)
        rows = {cfg.train.loss_rows for cfg in study.configs(size_name, tmp_path, 0, []).values()}
        with_logits = name in ("depth", "sharing", "distill")
        assert rows == ({0} if with_logits else {STDLIB_LOSS_ROWS}), name
        assert (LOSS_ROWS_NOTE in size.notes) != with_logits, name


def test_stdlib_sweeps_warm_up_as_the_full_runs_do(tmp_path) -> None:
    """A sweep run reaches its peak rate at the step the full run does (a warmup compressed
    with the sweep's budget mis-ranked rates for the depth study's deeper loop); the sharing size
    keeps the compressed sweep it ran, and says so."""
    from looplm.study.studies.common import COMPRESSED_SWEEP_NOTE
    from looplm.train.schedule import lr_at

    for name in ("mesh", "spiralformer", "sgt", "lt2", "depth", "sharing"):
        study = get_study(name)
        size = study.size("stdlib")
        run = next(iter(size.runs))
        full = study.configs("stdlib", tmp_path, 0, [])[run].train
        swept = study.configs("stdlib", tmp_path, 0, list(size.sweep.overrides))[run].train
        assert swept.max_steps == full.max_steps // 3
        compressed = name == "sharing"
        assert (swept.warmup == full.warmup) != compressed and (COMPRESSED_SWEEP_NOTE in size.notes) == compressed
        peak = full.warmup
        if not compressed:
            assert lr_at(peak, swept) == lr_at(peak, full) == full.lr and lr_at(peak - 1, swept) < full.lr
