"""docs/results/queue.sh, the committed lanes of the studies still to run: every command it
would run is a valid `looplm study` call of an existing study, size and variants, training
into docs/results; a table split between the lanes (depth, LT2) is written once, by whichever
lane finishes its half second, neither lane waiting for the other; and the runs two tables
share are the same configs, trained first."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from looplm.cli import build_parser
from looplm.study import get_study
from looplm.study.definition import variant_of
from looplm.study.sweep import reachable_rates, sweep_configs

REPO = Path(__file__).resolve().parents[2]
QUEUE = REPO / "docs" / "results" / "queue.sh"
RESULTS = REPO / "docs" / "results"
#: the tables whose rows the lanes split, a half each: out directory -> (study, size)
SPLIT = {"docs/results/depth-stdlib": ("depth", "stdlib"), "docs/results/lt2-stdlib": ("lt2", "stdlib")}


def lane_commands(lane: str, tmp_path: Path, state: str = "state") -> list[list[str]]:
    """The ``looplm`` argument lists lane ``lane`` runs (its markers in ``tmp_path / state``),
    recorded by a stand-in ``looplm`` that makes each study's ``--out`` folder. The script runs
    from a copy in ``tmp_path / "repo"`` holding docs/results' committed links, so what it
    creates stays out of the checkout."""
    bin_dir, log, repo = tmp_path / "bin", tmp_path / f"calls-{lane}-{state}", tmp_path / "repo"
    bin_dir.mkdir(exist_ok=True)
    if not repo.exists():
        for link in committed_links():
            (repo / link.parent.relative_to(REPO)).mkdir(parents=True, exist_ok=True)
            (repo / link.relative_to(REPO)).symlink_to(os.readlink(link))
        shutil.copy(QUEUE, repo / QUEUE.relative_to(REPO))
    fake = bin_dir / "looplm"
    fake.write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" >> {log}\nprintf "\\n" >> {log}\n'
                    'args=("$@"); for i in "${!args[@]}"; do\n'
                    '  if [ "${args[$i]}" = --out ]; then mkdir -p "${args[$((i + 1))]}"; fi\ndone\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "QUEUE_STATE": str(tmp_path / state)}
    subprocess.run(["bash", str(repo / QUEUE.relative_to(REPO)), lane], check=True, env=env, timeout=60)
    return [line.rstrip("\0").split("\0") for line in log.read_text().splitlines() if line]


def committed_links() -> list[Path]:
    """The links under docs/results: runs one table reads from another's directory."""
    return sorted(p for p in RESULTS.rglob("*") if p.is_symlink())


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
            assert set(args.variants.split(",")) <= {variant_of(run) for run in spec.runs}, argv
        assert Path(args.out).parts[:2] == ("docs", "results"), argv
        outs.append((args.out, args.variants))
    assert len(outs) == len(set(outs))  # no study trained twice into one directory
    for out, (name, size) in SPLIT.items():
        calls = [v for o, v in outs if o == out]
        halves = [set(v.split(",")) for v in calls if v]
        assert None in calls and len(halves) == 2 and halves[0].isdisjoint(halves[1]), out
        study = get_study(name, size)
        rows = set(study.variants(size))
        assert halves[0] | halves[1] == rows  # the halves are the table
        for pair in study.comparisons:  # a half's seed extension needs only its own rows
            assert not set(pair) <= rows or any(set(pair) <= half for half in halves), (out, pair)


def _table_calls(commands: list[list[str]], name: str) -> int:
    return sum(1 for argv in commands if argv[:2] == ["study", name] and "--variants" not in argv)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("first", ["a", "b"])
def test_the_lane_that_finishes_its_half_second_writes_the_table(tmp_path, first) -> None:
    second = "b" if first == "a" else "a"
    early, late = lane_commands(first, tmp_path), lane_commands(second, tmp_path)
    again = lane_commands(first, tmp_path)  # a restart after the tables were written
    for name, _ in SPLIT.values():
        assert _table_calls(early, name) == 0 and _table_calls(late, name) == 1, name
        halves = [argv for argv in late if argv[:2] == ["study", name]]
        assert "--variants" in halves[0] and "--variants" not in halves[1]  # its own half first, then the table
        assert _table_calls(again, name) == 0  # not written twice


def _lanes(tmp_path: Path) -> dict[str, list[tuple[str, str, str]]]:
    """Each lane's studies in its order: (out directory, study, size); a split table's half is left out."""
    parser = build_parser()
    lanes = {}
    for lane in "ba":
        args = [parser.parse_args(argv) for argv in lane_commands(lane, tmp_path)]
        lanes[lane] = [(a.out, a.name, a.size or "default") for a in args if not a.variants]
    return lanes


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_committed_link_is_a_run_of_the_same_config_trained_first(tmp_path) -> None:
    """A link docs/results/TABLE/[lr-sweep/lr-RATE/]ROW -> OTHER/[lr-sweep/lr-RATE/]ROW2 says
    ROW's runs are OTHER's ROW2 runs: at every seed the table may train (in a sweep: at that
    rate, a rate the sweep may try, with its budget) the configs are equal but for where they
    live; OTHER runs before TABLE in the same lane, which makes a row link's target first."""
    lanes = _lanes(tmp_path)
    links = committed_links()
    assert {link.relative_to(RESULTS).parts[0] for link in links} == {"ladder-bias-sweep", "spiralformer-stdlib"}
    for link in links:
        target = Path(os.path.normpath(link.parent / os.readlink(link)))
        mine, theirs = link.relative_to(REPO), target.relative_to(REPO)
        table, other = str(Path(*mine.parts[:3])), str(Path(*theirs.parts[:3]))
        assert mine.parts[3:-1] == theirs.parts[3:-1], link  # a row for a row, a sweep rate's run for that rate's
        (lane,) = [lane for lane, studies in lanes.items() if table in [out for out, _, _ in studies]]
        outs = [out for out, _, _ in lanes[lane]]
        assert other in outs and outs.index(other) < outs.index(table), link
        (name, size), (other_name, other_size) = ({out: (n, z) for out, n, z in lanes[lane]}[d] for d in (table, other))
        study, other_study = get_study(name, size), get_study(other_name, other_size)
        spec = study.size(size)
        if mine.parts[3] == "lr-sweep":
            rate = float(mine.parts[4].removeprefix("lr-"))
            assert rate in reachable_rates(spec.sweep), link
            pairs = [(sweep_configs(study, size, Path(table), [], rate),
                      sweep_configs(other_study, other_size, Path(other), [], rate))]
        else:
            assert (tmp_path / "repo" / theirs).is_dir(), link  # the lane made the target before the table ran
            pairs = [(study.configs(size, Path(table), seed), other_study.configs(other_size, Path(other), seed))
                     for seed in range(spec.max_seeds or spec.seeds)]
        for configs, other_configs in pairs:
            a, b = configs[mine.parts[-1]].to_dict(), other_configs[theirs.parts[-1]].to_dict()
            a["train"].pop("out_dir"), b["train"].pop("out_dir")
            assert a == b, link


def write_run(run: Path, steps: int, measured: bool) -> None:
    """A run's records as a study leaves them: at ``steps`` of 4, with its measures or not."""
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"steps": steps, "config": {"train": {"max_steps": 4}}}))
    (run / "metrics.jsonl").write_text("{}\n")
    if measured:
        (run / "study.json").write_text("{}")


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None, reason="needs bash and git")
def test_stage_adds_the_records_of_finished_runs_only(tmp_path) -> None:
    repo = tmp_path / "repo"
    results = repo / "docs" / "results"
    finished = {"mesh-stdlib/mesh/seed-0": True, "mesh-stdlib/lr-sweep/lr-0.004/mesh/seed-0": False}
    for run, measured in finished.items():
        write_run(results / run, 4, measured)
    write_run(results / "mesh-stdlib/base/seed-0", 4, False)  # finished, its measures not yet written
    write_run(results / "mesh-stdlib/base/seed-1", 2, True)  # cut short: starts over elsewhere
    shutil.copy(QUEUE, results / "queue.sh")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(["bash", "docs/results/queue.sh", "stage"], cwd=repo, env=env, capture_output=True,
                          text=True, check=True, timeout=120)
    staged = subprocess.run(["git", "diff", "--cached", "--name-only"], cwd=repo, capture_output=True, text=True,
                            check=True).stdout.split()
    expected = [f"docs/results/{run}/{name}" for run, measured in finished.items()
                for name in ("summary.json", "metrics.jsonl", "study.json") if measured or name != "study.json"]
    assert sorted(staged) == sorted(expected), done.stdout
    assert f"staged {len(expected)} files of finished runs" in done.stdout
