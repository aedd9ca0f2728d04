"""The claims table: verdicts read from runs.csv paired by seed, every claim naming real rows,
and the README's table equal to what the committed tables give."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from looplm.cli import main
from looplm.config_base import ConfigError
from looplm.study import get_study
from looplm.study.claims import BEGIN, CLAIMS, END, Claim, claims_markdown, read_rows, replace_block, verdict
from looplm.study.results import INCOMPLETE

ROOT = Path(__file__).resolve().parents[2]


def write_runs(path: Path, rows: list[dict]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["study", "run", "variant", "seed", *keys])
        writer.writeheader()
        for r in rows:
            writer.writerow({"study": "s", "run": r["variant"], **r})


def lm(variant, seed, loss, **more):
    return {"variant": variant, "seed": seed, "val_loss": loss, **more}


def claim(variant="a", reference="ref", tables=("t",), **kw) -> Claim:
    return Claim("P", "a beats ref", "p.txt", tables, variant, reference, **kw)


def test_verdicts_follow_the_paired_differences(tmp_path) -> None:
    write_runs(tmp_path / "t", [
        lm("ref", 0, 2.0), lm("ref", 1, 2.1), lm("ref", 2, 2.2),
        lm("a", 0, 1.9), lm("a", 1, 2.0), lm("a", 2, 2.1),          # −0.1 every seed: reproduced
        lm("b", 0, 2.1), lm("b", 1, 2.2), lm("b", 2, 2.31),         # +0.1: reversed
        lm("c", 0, 1.9), lm("c", 1, 2.2), lm("c", 2, 2.25),         # −0.1, +0.1, +0.05: not settled
        lm("d", 0, 1.0),                                            # one seed: not settled
    ])
    words = {v: verdict(claim(v), tmp_path).word for v in "abcd"}
    assert words == {"a": "reproduced", "b": "reversed", "c": "not settled", "d": "not settled"}
    a = verdict(claim("a"), tmp_path)
    assert a.table == "t" and a.paired.seeds == [0, 1, 2] and a.paired.differences == pytest.approx([-0.1] * 3)
    assert a.evidence().startswith("a − ref: −0.1000 ± 0.0000; a lower in 3 of 3 seeds, over 2 sd")
    assert "b higher" not in verdict(claim("b"), tmp_path).evidence()  # the paper's direction is named
    assert verdict(claim("b", better="higher"), tmp_path).word == "reproduced"
    assert verdict(claim("x"), tmp_path).word == "not run yet"  # no seed has both rows
    assert "no seed has both rows in t" in verdict(claim("x"), tmp_path).evidence()


def test_a_claim_reads_its_first_table_present_and_says_when_none_is(tmp_path) -> None:
    write_runs(tmp_path / "t", [lm("ref", 0, 2.0), lm("ref", 1, 2.0), lm("a", 0, 2.5), lm("a", 1, 2.6)])
    both = claim(tables=("t-stdlib", "t"))
    assert verdict(both, tmp_path).table == "t" and verdict(both, tmp_path).word == "reversed"
    write_runs(tmp_path / "t-stdlib", [lm("ref", s, 2.0 + s) for s in range(3)] + [lm("a", s, 1.9 + s) for s in range(3)])
    assert verdict(both, tmp_path).table == "t-stdlib" and verdict(both, tmp_path).word == "reproduced"
    (tmp_path / "t-stdlib" / INCOMPLETE).write_text("still training\n")  # a study's half, or one under way
    assert verdict(both, tmp_path).table == "t"
    (tmp_path / "t-stdlib" / INCOMPLETE).unlink()
    missing = verdict(claim(tables=("u-stdlib", "u")), tmp_path)
    assert missing.word == "not run yet" and missing.evidence() == "no table yet (docs/results/u-stdlib)"
    untested = verdict(Claim("P", "c", "p.txt", untested="too small here"), tmp_path)
    assert untested.word == "untested at this scale" and untested.evidence() == "too small here"


def test_parts_merge_and_a_row_can_be_its_own_reference(tmp_path) -> None:
    """A row's runs (lt2's lm and state parts) merge per seed; reference_metric compares two
    metrics of one row (the loss at 4× the trained count against the loss); percent in pp."""
    write_runs(tmp_path / "t", [
        {"variant": "a", "seed": 0, "val_loss": 2.0, "at_max": 1.9},
        {"variant": "a", "seed": 0, "acc": 0.5, "val_loss": ""},
        {"variant": "a", "seed": 1, "val_loss": 2.1, "at_max": 2.0},
        {"variant": "a", "seed": 1, "acc": 0.6},
        {"variant": "ref", "seed": 0, "acc": 0.2}, {"variant": "ref", "seed": 1, "acc": 0.3},
    ])
    assert read_rows(tmp_path / "t" / "runs.csv")["a", 0] == {"seed": 0.0, "val_loss": 2.0, "at_max": 1.9, "acc": 0.5}
    own = verdict(claim("a", "a", metric="at_max", reference_metric="val_loss"), tmp_path)
    assert own.paired.differences == pytest.approx([-0.1, -0.1]) and own.word == "reproduced"
    assert own.evidence().startswith("a − a val_loss: −0.1000")
    acc = verdict(claim("a", "ref", metric="acc", better="higher", percent=True), tmp_path)
    assert acc.paired.differences == pytest.approx([30.0, 30.0]) and "+30.0 ± 0.0 pp" in acc.evidence()


def test_bad_claims_name_the_field() -> None:
    with pytest.raises(ConfigError, match="claim.better"):
        claim(better="smaller")
    with pytest.raises(ConfigError, match="claim.tables"):
        claim(untested="why")  # tables and a reason not to have any
    with pytest.raises(ConfigError, match="claim.tables"):
        Claim("P", "c", "p.txt")  # neither


@pytest.mark.parametrize("c", CLAIMS, ids=lambda c: f"{c.paper}: {c.text}"[:60])
def test_every_claim_names_rows_and_metrics_of_its_study(c) -> None:
    if c.untested is not None:
        return
    study = get_study(c.tables[0].split("-")[0])
    variants = {v for size in study.sizes for v in study.variants(size)}
    assert {c.variant, c.reference} <= variants
    keys = {m.key for m in study.metrics}
    for table in c.tables:
        path = ROOT / "docs" / "results" / table / "runs.csv"
        if path.is_file():
            keys |= set(next(csv.reader(open(path))))
    assert {c.metric, c.reference_metric or c.metric} <= keys


def test_the_readme_table_is_what_the_committed_tables_give() -> None:
    """Regenerate with `looplm claims --write README.md` after committing a table."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index(BEGIN) + len(BEGIN):readme.index(END)].strip()
    assert block == claims_markdown(ROOT / "docs" / "results")


def test_cli_prints_and_writes_the_table(tmp_path, capsys, caplog) -> None:
    write_runs(tmp_path / "mesh", [lm("base", s, 2.0) for s in range(3)] + [lm("mesh", s, 1.9 - s / 100) for s in range(3)])
    assert main(["claims", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| MeSH | mesh beats plain recursion" in out and "**reproduced**" in out and "**not run yet**" in out
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{BEGIN}\nstale\n{END}\nrest\n")
    assert main(["claims", "--results", str(tmp_path), "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(f"intro\n{BEGIN}\n| paper |") and text.endswith(f"{END}\nrest\n") and "stale" not in text
    assert text == replace_block(text, claims_markdown(tmp_path))  # idempotent
    doc.write_text("no markers\n")
    assert main(["claims", "--results", str(tmp_path), "--write", str(doc)]) == 2
    assert "claims markers" in caplog.text and doc.read_text() == "no markers\n"
