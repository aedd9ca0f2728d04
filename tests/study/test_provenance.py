"""Which code trained a study's runs: recorded per training session, reported in results.md."""

from __future__ import annotations

from types import SimpleNamespace

from looplm import provenance
from looplm.study.results import dirty_warning, trained_by
from looplm.study.runs import Run
from looplm.train import Trainer, read_metrics
from tests.train.helpers import run_config


def test_code_version_names_the_checkout():
    code = provenance.code_version()
    assert code.split(" ")[0] not in ("", "unknown")  # the installed version
    assert provenance.is_dirty("0.1.0 (git 1a3b28f-dirty)") and not provenance.is_dirty(code.replace("-dirty", ""))


def test_every_session_records_its_code_and_the_table_names_each(tmp_path, monkeypatch):
    import looplm.train.trainer as trainer_module

    cfg = run_config(tmp_path / "run", max_steps=4, save_every=2)
    monkeypatch.setattr(trainer_module, "code_version", lambda: "0.1.0 (git aaaaaaa)")
    Trainer(cfg, progress=False).fit(stop_after=2)
    monkeypatch.setattr(trainer_module, "code_version", lambda: "0.1.0 (git bbbbbbb-dirty)")
    Trainer(cfg, resume=True, progress=False).fit()
    sessions = [(e["event"], e.get("code")) for e in read_metrics(tmp_path / "run" / "metrics.jsonl")
                if e["event"] in ("start", "resume")]
    assert sessions == [("start", "0.1.0 (git aaaaaaa)"), ("resume", "0.1.0 (git bbbbbbb-dirty)")]
    cpus = [e.get("cpu") for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] in ("start", "resume")]
    assert cpus == [provenance.cpu_name()] * 2 and cpus[0]  # each session's machine: float rounding depends on it

    resumed = Run("a", 0, tmp_path / "run", cfg, {}, reused=True)
    assert resumed.code == ["0.1.0 (git aaaaaaa)", "0.1.0 (git bbbbbbb-dirty)"]
    old = tmp_path / "old"  # a run trained before sessions recorded their code
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"event": "start", "step": 0, "time": 1.0}\n')
    unrecorded = Run("b", 0, old, cfg, {}, reused=True)
    assert unrecorded.code == []

    result = SimpleNamespace(runs={"a": [resumed], "b": [unrecorded, resumed]})
    assert trained_by(result) == ("looplm 0.1.0 (git aaaaaaa) (2 runs); looplm 0.1.0 (git bbbbbbb-dirty) (2 runs); "
                                  "1 run trained before runs recorded their code")
    clean = {"looplm": "0.1.0 (git ccccccc)"}
    assert "uncommitted changes (0.1.0 (git bbbbbbb-dirty))" in dirty_warning(clean, result)  # a run's session
    assert dirty_warning(clean, SimpleNamespace(runs={"b": [unrecorded]})) is None


def test_only_looplms_own_files_make_a_checkout_dirty(tmp_path):
    """A README edit or the records a study writes under docs/results change nothing a run
    computes; an edit to the package (tracked or new) or to pyproject.toml's pins does."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    package = tmp_path / "src" / "pkg"
    package.mkdir(parents=True)
    for path in (package / "mod.py", tmp_path / "pyproject.toml", tmp_path / "README.md"):
        path.write_text("x = 1\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    clean = provenance.git_commit(package)
    assert clean and not provenance.is_dirty(clean)
    (tmp_path / "README.md").write_text("edited\n")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "metrics.jsonl").write_text("{}\n")
    assert provenance.git_commit(package) == clean
    for edit in (package / "mod.py", package / "new.py", tmp_path / "pyproject.toml"):
        before = edit.read_text() if edit.exists() else None
        edit.write_text("x = 2\n")
        assert provenance.git_commit(package) == clean + provenance.DIRTY, edit
        edit.unlink() if before is None else edit.write_text(before)
    assert provenance.git_commit(package) == clean
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    assert provenance.git_commit(outside) is None  # not a checkout: the version alone
