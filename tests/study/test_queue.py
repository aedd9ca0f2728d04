"""docs/results/queue.sh, the committed lanes of the studies still to run: every command it
would run is a valid `looplm study` call of an existing study, size and variants, training
into docs/results; and the depth table is written once, by whichever lane finishes its half
second, neither lane waiting for the other."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from looplm.cli import build_parser
from looplm.study import get_study
from looplm.study.studies import ACT_RUNGS

REPO = Path(__file__).resolve().parents[2]
QUEUE = REPO / "docs" / "results" / "queue.sh"
LINKS = REPO / "docs" / "results" / "ladder-bias-sweep"  # the bias sweep's rows that are the ladder table's runs


def lane_commands(lane: str, tmp_path: Path, state: str = "state") -> list[list[str]]:
    """The ``looplm`` argument lists lane ``lane`` runs (its markers in ``tmp_path / state``),
    recorded by a stand-in ``looplm``; the script runs from a copy of the repository's
    docs/results links in ``tmp_path / "repo"``, so what it creates there stays out of the checkout."""
    bin_dir, log, repo = tmp_path / "bin", tmp_path / f"calls-{lane}-{state}", tmp_path / "repo"
    bin_dir.mkdir(exist_ok=True)
    if not repo.exists():
        shutil.copytree(LINKS, repo / LINKS.relative_to(REPO), symlinks=True)
        shutil.copy(QUEUE, repo / QUEUE.relative_to(REPO))
    fake = bin_dir / "looplm"
    fake.write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" >> {log}\nprintf "\\n" >> {log}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "QUEUE_STATE": str(tmp_path / state)}
    subprocess.run(["bash", str(repo / QUEUE.relative_to(REPO)), lane], check=True, env=env, timeout=60)
    return [line.rstrip("\0").split("\0") for line in log.read_text().splitlines() if line]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_queued_study_is_a_valid_call_into_docs_results(tmp_path) -> None:
    commands = lane_commands("b", tmp_path) + lane_commands("a", tmp_path)
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


def _table_calls(commands: list[list[str]]) -> int:
    return sum(1 for argv in commands if argv[:2] == ["study", "depth"] and "--variants" not in argv)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("first", ["a", "b"])
def test_the_lane_that_finishes_its_depth_half_second_writes_the_table(tmp_path, first) -> None:
    second = "b" if first == "a" else "a"
    early, late = lane_commands(first, tmp_path), lane_commands(second, tmp_path)
    assert _table_calls(early) == 0 and _table_calls(late) == 1
    halves = [argv for argv in late if argv[:2] == ["study", "depth"]]
    assert "--variants" in halves[0] and "--variants" not in halves[1]  # its own half first, then the table
    # a lane run again (a restart) after the table was written does not write it twice
    assert _table_calls(lane_commands(first, tmp_path)) == 0


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_bias_sweeps_default_bias_rows_are_the_ladder_tables_runs(tmp_path) -> None:
    """Each ACT rung's default-bias row of the bias sweep is a committed link to the ladder
    table's runs of that rung, whose configs it shares seed by seed (trained once, read by
    both); lane a trains the ladder table first and makes the links' targets before the sweep."""
    sweep, ladder = get_study("ladder", "bias-sweep"), get_study("ladder", "default")
    links = {p.name: p for p in LINKS.iterdir() if p.is_symlink()}
    assert sorted(links) == sorted(ACT_RUNGS)
    for rung, link in links.items():
        assert os.readlink(link) == f"../ladder/{rung}"
        for seed in range(sweep.size("bias-sweep").seeds):
            mine = sweep.configs("bias-sweep", LINKS, seed)[rung].to_dict()
            theirs = ladder.configs("default", LINKS.parent / "ladder", seed)[rung].to_dict()
            mine["train"].pop("out_dir"), theirs["train"].pop("out_dir")
            assert mine == theirs, (rung, seed)
    ladder_outs = [argv[argv.index("--out") + 1] for argv in lane_commands("a", tmp_path) if argv[1] == "ladder"]
    assert ladder_outs == ["docs/results/ladder", "docs/results/ladder-bias-sweep"]
    for rung in links:
        assert (tmp_path / "repo" / "docs" / "results" / "ladder" / rung).is_dir()  # the links resolve
