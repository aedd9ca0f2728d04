"""docs/results/ladder-paper.sh, the paper-size ladder on a lent GPU a few rungs per device
call (issue 28): it trains the rungs it has time for, packs the finished runs' records
(only those) into one file for the device to hand back, and what it packs is enough for
`looplm study` to read every run back on a CPU and write the table, training nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docs" / "results" / "ladder-paper.sh"
STUDY = Path("docs/results/ladder-paper")


def run_script(repo: Path, out: Path, **env: str) -> str:
    """The script from a copy in ``repo`` (what it writes stays out of the checkout), the
    ladder's quick size on the CPU standing in for the paper's size on a GPU."""
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO / "src"), "LADDER_PAPER_ARGS": "--quick train.device=cpu", **env}
    done = subprocess.run(["bash", str(repo / SCRIPT.relative_to(REPO))], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return done.stdout + done.stderr


def test_finished_rungs_come_back_as_records_the_study_reads_back(tmp_path):
    repo, out, here = tmp_path / "device", tmp_path / "out", tmp_path / "here"
    (repo / SCRIPT.parent.relative_to(REPO)).mkdir(parents=True)
    shutil.copy(SCRIPT, repo / SCRIPT.relative_to(REPO))
    unfinished = repo / STUDY / "tied" / "seed-0"  # a rung cut at the deadline: its records stay behind
    unfinished.mkdir(parents=True)
    (unfinished / "summary.json").write_text(json.dumps({"steps": 2, "config": {"train": {"max_steps": 4}}}))
    (unfinished / "study.json").write_text("{}")

    log = run_script(repo, out, LADDER_PAPER_RUNGS="dense", LADDER_PAPER_RUNG="5")
    with tarfile.open(out / "ladder-paper.tgz") as tar:
        names = sorted(tar.getnames())
        assert names == sorted(str(STUDY / rung / "seed-0" / f) for rung in ("dense",)
                               for f in ("summary.json", "metrics.jsonl", "study.json")), names
        tar.extractall(here, filter="data")
    assert "the records of 1 finished run in" in log

    # too little time left for a rung: none starts, and the records already there still come back
    log = run_script(repo, out, LADDER_PAPER_RUNGS="tied", LADDER_PAPER_RUNG="100000")
    assert "tied: not started" in log and "the records of 1 finished run in" in log

    # here, from the records alone: every run read back, nothing trained, the table written
    read = subprocess.run([sys.executable, "-m", "looplm", "study", "ladder", "--quick", "--seeds", "1",
                           "--variants", "dense", "--out", str(STUDY), "train.device=cpu", "--no-progress"],
                          cwd=here, env={**os.environ, "PYTHONPATH": str(REPO / "src")}, capture_output=True,
                          text=True, timeout=300, check=True)
    assert (read.stdout + read.stderr).count("finished run reused") == 1, read.stderr
    assert not list(here.rglob("checkpoints")) and (here / STUDY / "results.md").is_file()
