"""The stages as Trainer runs: stage 1 alignment, the KL-guided selector, exact resume of
stages 1 and 2, and the pipeline from the command line."""

from __future__ import annotations

import json

import pytest
import torch

from looplm import LoopLM
from looplm.cli import main
from looplm.distill import KDConfig, init_student, student_config
from looplm.distill.alignment import alignment_loss, record_teacher
from looplm.distill.selection import attention_restored, kl_guided, uniform_layers
from looplm.distill.stages import alignment_trainer, kd_trainer
from looplm.train import Trainer, read_metrics, train_losses
from tests.distill.helpers import GDN, frozen_teacher, student_run
from tests.train.helpers import assert_same_weights, checkpoint_weights


def test_stage1_drives_the_alignment_mse_down(tmp_path):
    teacher = frozen_teacher(init_std=0.2)  # attention outputs well above rounding
    cfg = student_run(teacher, [], tmp_path, max_steps=30, lr=1e-2, warmup_steps=0)
    trainer = alignment_trainer(cfg, teacher, lambda s: init_student(s, teacher), progress=False)
    assert type(trainer) is Trainer  # a stage is the Trainer's seams, not a subclass
    frozen = {n: p.clone() for n, p in trainer.model.named_parameters() if ".attn." not in n}
    x = torch.randint(0, 257, (4, 32), generator=torch.Generator().manual_seed(5))
    calls = record_teacher(teacher, x)
    assert len(calls) == 1 + 2 * 2 + 1  # every block, the core's at both iterations
    with torch.no_grad():
        before = alignment_loss(trainer.model, calls).item()
    trainer.fit()
    with torch.no_grad():
        after = alignment_loss(trainer.model, calls).item()
    assert after < 0.5 * before, (before, after)
    for name, param in trainer.model.named_parameters():  # only the linear mixers learned
        if name in frozen:
            assert torch.equal(param, frozen[name]), name
    evals = [e for e in read_metrics(tmp_path / "metrics.jsonl") if e["event"] == "distill_eval"]
    assert evals and evals[-1]["align_mse"] > 0


def test_kl_selector_picks_the_planted_layer():
    planted = 2  # core.0.1: the only block whose attention changes the residual stream
    teacher = frozen_teacher(seed=1)
    for index, path in enumerate(["prelude.0", "core.0.0", "core.0.1", "coda.0"]):
        o_proj = teacher.get_submodule(path).attn.o_proj
        with torch.no_grad():
            if index == planted:
                o_proj.weight.mul_(40.0)
            else:
                o_proj.weight.zero_()
                o_proj.bias.zero_()
    aligned = LoopLM(student_config(teacher.cfg, GDN, []))
    init_student(aligned, teacher)
    batches = [torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    selection = kl_guided(teacher, aligned, 1, batches)
    assert selection.layers == [planted]
    assert selection.scores[planted] > 0.5 * selection.base_kl
    assert all(abs(selection.scores[i]) < 1e-3 * selection.base_kl for i in (0, 1, 3))
    assert uniform_layers(4, 1) == [3] and uniform_layers(24, 6) == [3, 7, 11, 15, 19, 23]


@torch.no_grad()
def test_restoring_one_block_in_place_equals_the_built_hybrid():
    teacher = frozen_teacher(seed=2)
    aligned = LoopLM(student_config(teacher.cfg, GDN, []))
    init_student(aligned, teacher)
    torch.manual_seed(3)
    for p in aligned.parameters():  # a stage-1 student whose mixers moved away from their init
        p.add_(0.01 * torch.randn_like(p))
    x = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(4))
    before = aligned(x).logits
    for index in range(4):
        built = LoopLM(student_config(teacher.cfg, GDN, [index]))
        init_student(built, teacher, linear_from=aligned)
        for path, module in built.named_parameters():  # the shared weights are the aligned student's
            if path in dict(aligned.named_parameters()) and ".attn." not in path:
                module.copy_(dict(aligned.named_parameters())[path])
        with attention_restored(aligned, teacher, index) as candidate:
            torch.testing.assert_close(candidate(x).logits, built(x).logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(aligned(x).logits, before, atol=0, rtol=0)  # put back


def _run(kind, teacher, out_dir, **train):
    if kind == "align":
        cfg = student_run(teacher, [], out_dir, **train)
        return lambda resume=False: alignment_trainer(cfg, teacher, lambda s: init_student(s, teacher), resume=resume,
                                                      progress=False)
    cfg = student_run(teacher, [1], out_dir, **train)
    kd = KDConfig(top_k=16, schedule="per_loop", warmup_fraction=0.2, uniform_fraction=0.4)
    return lambda resume=False: kd_trainer(cfg, teacher, lambda s: init_student(s, teacher), kd=kd,
                                           lengths=(8, 16, 32), resume=resume, progress=False)


@pytest.mark.parametrize("kind", ["align", "kd"])
def test_resume_mid_stage_is_exact(tmp_path, kind):
    teacher = frozen_teacher()
    _run(kind, teacher, tmp_path / "whole", max_steps=6, save_every=3)().fit()
    _run(kind, teacher, tmp_path / "split", max_steps=6, save_every=3)().fit(stop_after=3)
    resumed = _run(kind, teacher, tmp_path / "split", max_steps=6, save_every=3)(resume=True)
    assert resumed.step == 3
    resumed.fit()
    whole, split = train_losses(tmp_path / "whole" / "metrics.jsonl"), train_losses(tmp_path / "split" / "metrics.jsonl")
    assert sorted(whole) == list(range(1, 7)) and split == whole
    assert_same_weights(checkpoint_weights(tmp_path / "whole", 6), checkpoint_weights(tmp_path / "split", 6))
    if kind == "kd":  # the length schedule ran: 8, 8, 16, 16, 32, 32
        lengths = [e["aux_seq_len"] for e in read_metrics(tmp_path / "whole" / "metrics.jsonl") if e["event"] == "train"]
        assert lengths == [8, 8, 16, 16, 32, 32]


def test_distill_command_runs_every_stage_on_a_looplm_run(tmp_path):
    common = ["train.batch_size=4", "train.sample_tokens=0", "train.eval_every=0", "train.device=cpu",
              "train.precision=fp32", "--no-progress"]
    teacher = tmp_path / "teacher"
    assert main(["train", "model.d_model=32", "model.n_heads=4", "model.layout=1+2R2+1", "model.max_seq_len=64",
                 "data.seq_len=32", "data.val_batches=2", "train.max_steps=3", f"train.out_dir={teacher}", *common]) == 0
    out = tmp_path / "distilled"
    args = ["distill", str(teacher), f"train.out_dir={out}", "distill.stage1.max_steps=2", "distill.stage2.max_steps=3",
            "distill.stage3.max_steps=2", "distill.select_batches=1", *common]
    assert main(args) == 0
    selection = json.loads((out / "selection.json").read_text())
    assert selection["selector"] == "kl" and len(selection["layers"]) == 1 and len(selection["scores"]) == 4
    for stage in ("stage1", "stage2", "stage3"):
        assert json.loads((out / stage / "summary.json").read_text())["steps"] >= 2
    student = LoopLM.from_pretrained(out / "stage3")
    assert student.cfg.hybrid.layers == tuple(selection["layers"])
    assert main([*args, "--resume"]) == 0  # every stage finished: nothing to do
    assert main(["distill", str(teacher), f"train.out_dir={tmp_path / 'other'}", "--stage", "2", *common]) == 2
