"""Checkpoints: round trip, atomic commit under crashes, corruption and config checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from looplm import LoopLM
from looplm.train import CheckpointError, build_optimizer, load_checkpoint, save_checkpoint
from looplm.train import checkpoint as ckpt_module
from tests.train.helpers import run_config


def trained_pair(cfg, steps: int = 2, seed: int = 0):
    """A model and optimiser after a few updates (so the optimiser has state)."""
    torch.manual_seed(seed)
    model = LoopLM(cfg.model)
    opt = build_optimizer(model, cfg.train)
    x = torch.randint(0, 257, (2, 16))
    for _ in range(steps):
        model(x, x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save(out_dir, cfg, model, opt, step, **kw):
    state = {"tokens_seen": step * 10, "data": {"epoch": 0, "offset": step}, "rng": ckpt_module.rng_state()}
    return save_checkpoint(out_dir, step=step, model=model, run_config=cfg, optimizer=opt, state=state, **kw)


@pytest.fixture
def cfg(tmp_path):
    return run_config(tmp_path / "run", topology="mesh")


def test_round_trip_restores_model_optimizer_and_state(tmp_path, cfg):
    model, opt = trained_pair(cfg)
    step_dir = save(tmp_path / "run", cfg, model, opt, 7)
    assert step_dir.name == "step_0000007"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "config.json", "manifest.json", "model.safetensors", "trainer.pt"
    ]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_0000007"
    fresh, fresh_opt = trained_pair(cfg, steps=1, seed=1)
    for where in (tmp_path / "run", tmp_path / "run" / "checkpoints", step_dir):
        loaded = load_checkpoint(where, model=fresh, optimizer=fresh_opt)
        assert loaded.path == step_dir and loaded.step == 7
    assert loaded.state["data"] == {"epoch": 0, "offset": 7} and loaded.state["tokens_seen"] == 70
    assert loaded.config == cfg.to_dict()
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    saved, restored = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert saved.keys() == restored.keys()
    for k in saved:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved[k][field], restored[k][field])
    # trainer.pt is plain data: loadable without unpickling code
    torch.load(step_dir / "trainer.pt", weights_only=True)


def test_tied_weights_round_trip(tmp_path):
    cfg = run_config(tmp_path / "run", model={"tie_embeddings": True, "topology": {"kind": "residual"}})
    model, opt = trained_pair(cfg)
    save(tmp_path / "run", cfg, model, opt, 1)
    fresh = LoopLM(cfg.model)
    load_checkpoint(tmp_path / "run", model=fresh)
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)


def test_crash_while_writing_keeps_previous_checkpoint(tmp_path, cfg, monkeypatch):
    model, opt = trained_pair(cfg)
    save(tmp_path / "run", cfg, model, opt, 1)

    def half_written(model, filename, *args, **kwargs):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_model", half_written)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path / "run", cfg, model, opt, 2)
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000001"]  # temp dir cleaned up
    assert load_checkpoint(tmp_path / "run", model=LoopLM(cfg.model)).step == 1


def test_killed_between_directory_rename_and_latest_update(tmp_path, cfg, monkeypatch):
    model, opt = trained_pair(cfg)
    save(tmp_path / "run", cfg, model, opt, 1)
    real_replace = os.replace

    def killed_at_latest(src, dst):
        if Path(dst).name == "latest":
            raise KeyboardInterrupt  # the process dies here
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_latest)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path / "run", cfg, model, opt, 2)
    monkeypatch.setattr(os, "replace", real_replace)
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_0000001"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    assert load_checkpoint(tmp_path / "run", model=LoopLM(cfg.model)).step == 1
    # the next save of the same step replaces the uncommitted directory and commits it
    save(tmp_path / "run", cfg, model, opt, 2)
    assert load_checkpoint(tmp_path / "run").step == 2


def test_killed_before_directory_rename_leaves_temp_dir_that_next_save_removes(tmp_path, cfg, monkeypatch):
    model, opt = trained_pair(cfg)
    save(tmp_path / "run", cfg, model, opt, 1)
    real_replace = os.replace

    def killed_at_rename(src, dst):
        if Path(dst).name.startswith("step_"):
            raise SystemExit(1)
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt_module.shutil, "rmtree", lambda *a, **k: None)  # a killed process cleans nothing up
    monkeypatch.setattr(os, "replace", killed_at_rename)
    with pytest.raises(SystemExit):
        save(tmp_path / "run", cfg, model, opt, 2)
    monkeypatch.undo()
    root = tmp_path / "run" / "checkpoints"
    assert any(p.name.startswith(".tmp-step_0000002") for p in root.iterdir())
    assert load_checkpoint(tmp_path / "run").step == 1
    save(tmp_path / "run", cfg, model, opt, 3)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000001", "step_0000003"]


@pytest.mark.parametrize("file", ["model.safetensors", "trainer.pt", "config.json"])
def test_corrupted_file_is_refused(tmp_path, cfg, file):
    model, opt = trained_pair(cfg)
    step_dir = save(tmp_path / "run", cfg, model, opt, 1)
    data = bytearray((step_dir / file).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step_dir / file).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"corrupted: {file} has sha256"):
        load_checkpoint(tmp_path / "run", model=LoopLM(cfg.model))


def test_missing_files_are_refused(tmp_path, cfg):
    model, opt = trained_pair(cfg)
    step_dir = save(tmp_path / "run", cfg, model, opt, 1)
    (step_dir / "trainer.pt").unlink()
    with pytest.raises(CheckpointError, match="incomplete: missing trainer.pt"):
        load_checkpoint(step_dir)
    (step_dir / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        load_checkpoint(step_dir)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "elsewhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="expected a run directory"):
        load_checkpoint(tmp_path / "empty")


def test_other_model_config_is_refused_naming_the_fields(tmp_path, cfg):
    model, opt = trained_pair(cfg)
    save(tmp_path / "run", cfg, model, opt, 1)
    other = run_config(tmp_path / "run", topology="base", model={"d_model": 64})
    with pytest.raises(CheckpointError, match="different model") as err:
        load_checkpoint(tmp_path / "run", model_config=other.model)
    message = str(err.value)
    assert "model.d_model: checkpoint 32, this run 64" in message
    assert "model.topology.kind: checkpoint 'mesh', this run 'base'" in message
    assert "model.n_heads" not in message


def test_keep_last_prunes_older_step_directories(tmp_path, cfg):
    model, opt = trained_pair(cfg)
    for step in (1, 2, 3, 4):
        save(tmp_path / "run", cfg, model, opt, step, keep_last=2)
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000003", "step_0000004"]
