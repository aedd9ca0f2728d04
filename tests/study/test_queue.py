"""docs/results/queue.sh, the committed lanes of the studies still to run: every command it
would run is a valid `looplm study` call of an existing study, size and variants, training
into docs/results; and a lane that waits for the other starts once that one is done."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from looplm.cli import build_parser
from looplm.study import get_study

REPO = Path(__file__).resolve().parents[2]
QUEUE = REPO / "docs" / "results" / "queue.sh"


def lane_commands(lane: str, tmp_path: Path) -> list[list[str]]:
    """The ``looplm`` argument lists lane ``lane`` runs, recorded by a stand-in ``looplm``."""
    bin_dir, log = tmp_path / "bin", tmp_path / f"calls-{lane}"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "looplm"
    fake.write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" >> {log}\nprintf "\\n" >> {log}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "QUEUE_STATE": str(tmp_path / "state")}
    subprocess.run(["bash", str(QUEUE), lane], check=True, env=env, timeout=60)
    return [line.rstrip("\0").split("\0") for line in log.read_text().splitlines() if line]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_queued_study_is_a_valid_call_into_docs_results(tmp_path) -> None:
    commands = lane_commands("b", tmp_path) + lane_commands("a", tmp_path)  # b first: a waits for its depth half
    assert (tmp_path / "state" / "depth-huginn.done").is_file()
    parser = build_parser()
    outs = []
    for argv in commands:
        args = parser.parse_args(argv)
        assert args.command == "study" and args.threads == 1 and args.no_progress, argv
        size = args.size or "default"
        spec = get_study(args.name, size).size(size)
        if args.variants:
            assert set(args.variants.split(",")) <= set(spec.runs), argv
        assert Path(args.out).parts[:2] == ("docs", "results"), argv
        outs.append((args.out, args.variants))
    assert len(outs) == len(set(outs))  # no study trained twice into one directory
    depth = [v for out, v in outs if out == "docs/results/depth-stdlib"]
    halves = [set(v.split(",")) for v in depth if v]
    assert None in depth and halves[0].isdisjoint(halves[1])
    assert halves[0] | halves[1] == set(get_study("depth", "stdlib").size("stdlib").runs)  # the halves are the table
