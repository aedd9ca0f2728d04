"""``looplm study distill`` (issue 28): LT2's distillation (lt2.txt §5) as a study with paired
seeds. The quick size end to end: every row of every seed is an ordinary looplm run, the
hybrid rows share the seed's selected F, results.csv / paired.csv decide the rows against
the from-scratch hybrid; a distilled run interrupted mid-stage resumes exactly through the
runner's trainer hook; a row whose earlier runs are missing is refused with what to run."""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from looplm.cli import main
from looplm.errors import LoopLMError
from looplm.model import LoopLM
from looplm.study import get_study, run_study
from looplm.study import distillation
from looplm.study import runs as runs_module
from looplm.train import train_losses

ROWS = ["teacher", "stage1", "scratch-teacher-budget", "scratch", "distill-per-loop", "distill-final"]
HYBRID = ["scratch-teacher-budget", "scratch", "distill-per-loop", "distill-final"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("distill")
    return run_study("distill", out / "full", size="quick", threads=1)


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_every_row_of_every_seed_is_a_finished_looplm_run(quick) -> None:
    assert quick.seeds == [0, 1, 2] and list(quick.runs) == ROWS
    for name in ROWS:
        for run in quick.runs[name]:
            summary = json.loads((run.run_dir / "summary.json").read_text())
            assert summary["steps"] == summary["max_steps"] == run.config.train.max_steps
            assert LoopLM.from_pretrained(run.run_dir).cfg == run.config.model  # the config it trained with
    assert main(["eval", str(quick.runs["distill-per-loop"][0].run_dir)]) == 0


def test_the_models_and_budgets_of_the_rows(quick) -> None:
    """The teacher runs attention everywhere, stage 1 GDN everywhere, the hybrid rows GDN with
    the seed's selected F kept as attention; the student's budget (stage 1 + stage 2) is the
    from-scratch control's, and every row reads the teacher's data (the same held-out batches)."""
    for i, seed in enumerate(quick.seeds):
        runs = {name: quick.runs[name][i] for name in ROWS}
        teacher = runs["teacher"].config
        assert teacher.model.mixer.kind == "attention" and teacher.model.hybrid is None
        stage1 = runs["stage1"].config.model
        assert stage1.mixer.kind == "gated_deltanet" and stage1.hybrid is None
        selection = json.loads((runs["stage1"].run_dir / "selection.json").read_text())
        assert selection["selector"] == "kl" and len(selection["layers"]) == 1  # 25 % of 4 blocks
        for name in HYBRID:
            assert list(runs[name].config.model.hybrid.layers) == selection["layers"], (name, seed)
        assert {json.dumps(r.config.data.to_dict(), sort_keys=True) for r in runs.values()} == {
            json.dumps(teacher.data.to_dict(), sort_keys=True)}
        steps = {name: r.config.train.max_steps for name, r in runs.items()}
        student = {steps["stage1"] + steps[name] for name in distillation.DISTILLED}
        assert student == {steps["scratch"]}
        assert steps["scratch-teacher-budget"] == steps["teacher"] >= 4 * steps["distill-per-loop"]
        for name, schedule in distillation.DISTILLED.items():
            record = json.loads((runs[name].run_dir / "distill.json").read_text())
            assert record["distill"]["kd"]["schedule"] == schedule and record["selection"] == selection
            assert record["teacher"] == str(runs["teacher"].run_dir)
            assert any("aux_lm" in e for e in runs[name].events("train"))  # trained on the KD loss


def test_results_and_paired_tables_decide_against_the_scratch_hybrid(quick) -> None:
    out = quick.out_dir
    summary = {(r["variant"], r["metric"]): r for r in _csv(out / "results.csv")}
    for name in ROWS:
        assert int(summary[(name, "val_loss")]["n"]) == 3
        assert int(summary[(name, "val_loss_loop1")]["n"]) == 3  # per-loop losses: the teacher's loop is 4R2
    runs = {(r["variant"], r["seed"]): r for r in _csv(out / "runs.csv")}
    for seed in ("0", "1", "2"):
        stage1 = int(runs[("stage1", seed)]["tokens"])
        for name in distillation.DISTILLED:
            row = runs[(name, seed)]
            assert int(row["tokens"]) == stage1 + int(row["steps"]) * 2 * 16  # stage 1 + stage 2, batch 2 × 16
            assert float(row["val_loss_loop2"]) == pytest.approx(float(row["val_loss"]), abs=1e-5)
            assert float(row["kd_final"]) >= 0
        assert runs[("teacher", seed)]["match_tokens"] == ""  # trained before the from-scratch curve exists
        # FLOPs: a distilled row pays stage 1 and its teacher's forwards; at equal tokens distilling
        # costs more than training the hybrid from scratch, and the saving is the matched tokens' cost
        flops = {name: float(runs[(name, seed)]["train_flops"]) for name in ROWS}
        per_token = flops["scratch"] / int(runs[("scratch", seed)]["tokens"])
        assert flops["scratch-teacher-budget"] == pytest.approx(per_token * int(runs[("teacher", seed)]["tokens"]))
        for name in distillation.DISTILLED:
            assert flops[name] > flops["stage1"] + (flops["scratch"] - per_token * stage1)
            match = runs[(name, seed)]["match_tokens"]
            if match:
                assert float(runs[(name, seed)]["saved_flops"]) == pytest.approx(
                    float(match) * per_token - flops[name])
    paired = {(r["variant"], r["metric"]): r for r in _csv(out / "paired.csv")}
    assert {r["reference"] for r in paired.values()} == {"scratch"}
    row = paired[("distill-per-loop", "val_loss")]
    expected = [float(runs[("distill-per-loop", s)]["val_loss"]) - float(runs[("scratch", s)]["val_loss"])
                for s in ("0", "1", "2")]
    assert [float(d) for d in row["differences"].split()] == pytest.approx(expected, rel=1e-6)
    markdown = (out / "results.md").read_text()
    assert "looplm study distill --out" in markdown and "Kept softmax attention" in markdown
    assert "| distill-per-loop − scratch | val loss |" in markdown


def test_a_distilled_run_interrupted_mid_stage_resumes_exactly(quick, tmp_path, monkeypatch) -> None:
    """Rerunning the study skips finished runs; a stage-2 run cut after one step continues
    from its checkpoint through the trainer hook, with the losses of the uninterrupted run."""
    from looplm.distill import stages

    cut = tmp_path / "cut"
    shutil.copytree(quick.out_dir, cut)
    shutil.rmtree(cut / "distill-per-loop" / "seed-1")
    study = get_study("distill")
    cfg = distillation.prepare("distill-per-loop", study.configs("quick", cut, 1)["distill-per-loop"])
    distillation.trainer("distill-per-loop", cfg, False, False).fit(stop_after=1)
    trained = []
    for module in (runs_module, stages):
        real = module.Trainer

        def recording(run_cfg, *, _real=real, **kwargs):
            trained.append((run_cfg.train.out_dir, kwargs["resume"]))
            return _real(run_cfg, **kwargs)

        monkeypatch.setattr(module, "Trainer", recording)
    again = run_study("distill", cut, size="quick", threads=1)
    assert trained == [(str(cut / "distill-per-loop" / "seed-1"), True)]  # the rest were read back
    assert [r.reused for r in again.runs["distill-per-loop"]] == [True, False, True]
    resumed, full = again.runs["distill-per-loop"][1], quick.runs["distill-per-loop"][1]
    assert train_losses(resumed.run_dir / "metrics.jsonl") == train_losses(full.run_dir / "metrics.jsonl")
    assert again.measures["distill-per-loop"][1]["scalars"] == pytest.approx(
        quick.measures["distill-per-loop"][1]["scalars"])


def test_a_row_whose_earlier_runs_lost_their_checkpoints_trains_them_again(quick, tmp_path, monkeypatch) -> None:
    """A seed's teacher and stage 1 kept as records only (a machine that keeps untracked files
    but not ignored ones: checkpoints) are trained again from their recorded configs when a
    later row needs their weights: the same runs, so the row trains as it did from the first."""
    from looplm.distill import stages

    cut = tmp_path / "cut"
    shutil.copytree(quick.out_dir, cut)
    for run in ("teacher", "stage1"):
        shutil.rmtree(cut / run / "seed-1" / "checkpoints")
    shutil.rmtree(cut / "distill-final" / "seed-1")
    trained = []
    for module in (runs_module, stages, distillation):
        real = module.Trainer

        def recording(run_cfg, *, _real=real, **kwargs):
            trained.append(run_cfg.train.out_dir)
            return _real(run_cfg, **kwargs)

        monkeypatch.setattr(module, "Trainer", recording)
    again = run_study("distill", cut, size="quick", threads=1)
    assert trained == [str(cut / run / "seed-1") for run in ("teacher", "stage1", "distill-final")]
    for run in ("teacher", "stage1", "distill-final"):
        assert train_losses(cut / run / "seed-1" / "metrics.jsonl") == train_losses(
            quick.out_dir / run / "seed-1" / "metrics.jsonl"), run
    assert again.measures["distill-final"][1]["scalars"] == pytest.approx(
        quick.measures["distill-final"][1]["scalars"])


def test_a_teacher_trained_again_to_other_losses_is_refused(quick, tmp_path) -> None:
    cut = tmp_path / "cut"
    shutil.copytree(quick.out_dir / "teacher", cut / "teacher")
    shutil.rmtree(cut / "teacher" / "seed-0" / "checkpoints")
    summary = cut / "teacher" / "seed-0" / "summary.json"
    recorded = json.loads(summary.read_text())
    summary.write_text(json.dumps({**recorded, "val_loss": recorded["val_loss"] + 0.1}))
    with pytest.raises(LoopLMError, match="not its recorded"):
        distillation._weights(cut / "teacher" / "seed-0", "teacher", "stage1")


def test_a_row_without_its_earlier_runs_is_refused(tmp_path) -> None:
    with pytest.raises(LoopLMError, match="finished stage1 run"):
        run_study("distill", tmp_path, size="quick", seeds=1, variants=["distill-per-loop"])
    with pytest.raises(LoopLMError, match="finished teacher run"):
        run_study("distill", tmp_path, size="quick", seeds=1, variants=["stage1"])


def test_default_size_reads_the_unrepeated_corpus_at_a_quarter_of_the_teachers_tokens() -> None:
    configs = get_study("distill").configs("default", "unused", 0)
    teacher = configs["teacher"]
    assert teacher.data.source == "python-stdlib" and teacher.model.d_model == 128 and teacher.model.layout == "4R3"
    tokens = {name: c.train.max_steps * c.train.batch_size * c.data.seq_len for name, c in configs.items()}
    assert tokens["teacher"] <= 8_200_000  # single epoch of the training split
    assert 4 * (tokens["stage1"] + tokens["distill-per-loop"]) <= tokens["teacher"]
    assert get_study("distill").size("default").seeds == 3


@pytest.mark.parametrize("curve, target, expected", [
    ([[10, 3.0], [20, 2.0], [30, 1.0]], 1.5, 25.0),  # interpolated between evaluations
    ([[10, 3.0], [20, 2.0]], 3.5, 10.0),  # already reached at the first evaluation
    ([[10, 3.0], [20, 2.0]], 1.0, None),  # never reached
])
def test_tokens_to_reach(curve, target, expected) -> None:
    assert distillation.tokens_to_reach(curve, target) == expected
