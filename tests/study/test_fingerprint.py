"""The measure fingerprint follows the measuring code and nothing else in its module."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from looplm.study.fingerprint import code_fingerprint

MODULE = '''
import dataclasses
from . import helpers

RATES = {rates}
NOTES = "{notes}"

@dataclasses.dataclass(frozen=True)
class Budget:
    steps: int = {steps}

def _scale(x):
    return x * {scale}

def measure(run):
    return {{"loss": _scale(run) + sum(RATES) + helpers.offset() + Budget().steps,
             "squares": [_scale(v) for v in range(2)]}}

def unrelated():
    return {unrelated}
'''
HELPERS = '''
def offset():
    return {offset}
'''


def load(tmp_path, counter=[0], *, rates="(1, 2)", notes="a", steps=3, scale=2, unrelated=0, offset=1):
    """Import a fresh package ``fpcase_N`` holding the case module and its helper, written
    with these values; returns its measure."""
    counter[0] += 1
    package = tmp_path / f"fpcase_{counter[0]}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text(textwrap.dedent(HELPERS.format(offset=offset)))
    (package / "measures.py").write_text(textwrap.dedent(MODULE.format(
        rates=rates, notes=notes, steps=steps, scale=scale, unrelated=unrelated)))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(f"{package.name}.measures").measure
    finally:
        sys.path.remove(str(tmp_path))


def fingerprint(measure) -> str:
    return code_fingerprint(measure, package=measure.__module__.split(".")[0])


def test_edits_beside_the_measure_keep_its_fingerprint(tmp_path):
    base = fingerprint(load(tmp_path))
    assert fingerprint(load(tmp_path, notes="other notes", unrelated=5)) == base


@pytest.mark.parametrize("edit", [{"scale": 3}, {"rates": "(1, 3)"}, {"steps": 4}, {"offset": 2}])
def test_edits_to_what_the_measure_reaches_change_it(tmp_path, edit):
    """A helper it calls (also inside a comprehension), a constant it reads, a class it
    builds, a function of a module it names as ``module.name``."""
    assert fingerprint(load(tmp_path, **edit)) != fingerprint(load(tmp_path))


def test_the_fingerprint_is_the_same_in_every_process(tmp_path):
    """A set of strings iterates in a per-process order; its constant is hashed sorted."""
    root = str(Path(__file__).parents[2])
    prints = set()
    for seed in (1, 2, 3):
        code = (f"import sys, pathlib; sys.path.insert(0, {root!r}); "
                "from tests.study.test_fingerprint import load, fingerprint; "
                f"print(fingerprint(load(pathlib.Path({str(tmp_path / str(seed))!r}), rates=repr(set('xyzw')))))")
        (tmp_path / str(seed)).mkdir()
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        prints.add(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  env=env).stdout.strip())
    assert len(prints) == 1 and len(prints.pop()) == 16


def test_measures_stored_under_another_key_are_measured_again(tmp_path):
    import dataclasses

    from looplm.study import measures as study_measures
    from looplm.study import runner
    from tests.study.test_study import TINY

    calls = []

    def counting(run):
        calls.append(run.run_dir)
        return study_measures.lm(run)

    study = dataclasses.replace(TINY, measure=counting)
    runner.run_study(study, tmp_path, size="quick")
    path = tmp_path / "a" / "seed-0" / runner.MEASURES_FILE
    stored = json.loads(path.read_text())
    runner.run_study(study, tmp_path, size="quick")
    assert len(calls) == 4  # read back, not measured again
    path.write_text(json.dumps({**stored, "code": "measured-by-other-code"}))
    runner.run_study(study, tmp_path, size="quick")
    assert len(calls) == 5 and json.loads(path.read_text())["code"] == runner.measure_fingerprint(counting)


def test_a_study_keys_its_measures_by_the_source_it_started_with(tmp_path):
    """A file edited while a study trains (a long sweep first) does not re-key what the
    process measures with the code it loaded."""
    import dataclasses
    import inspect

    from looplm.study import runner
    from tests.study.test_study import TINY

    (tmp_path / "fpedit").mkdir()
    (tmp_path / "fpedit" / "__init__.py").write_text("")
    source = tmp_path / "fpedit" / "measures.py"
    source.write_text("from looplm.study import measures\n\n\ndef measure(run):\n    return measures.lm(run)  # v1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        measure = importlib.import_module("fpedit.measures").measure
    finally:
        sys.path.remove(str(tmp_path))
    loaded = code_fingerprint(measure)

    def edit_then_train(name, cfg, resume, progress):
        source.write_text(source.read_text().replace("# v1", "# v2"))
        return None  # the default Trainer

    study = dataclasses.replace(TINY, measure=measure, trainer=edit_then_train)
    runner.run_study(study, tmp_path / "out", size="quick")
    assert inspect.getsource(measure).endswith("# v2\n") and code_fingerprint(measure) != loaded
    assert json.loads((tmp_path / "out" / "a" / "seed-0" / runner.MEASURES_FILE).read_text())["code"] == loaded


def test_a_run_two_studies_share_keeps_each_studys_measures(tmp_path):
    """A second study reaching the first one's run through a link measures it once, beside
    the first study's measures, and neither measures again when it reads the run back; a
    run trained afresh in that directory drops both."""
    import dataclasses

    from looplm.study import measures as study_measures
    from looplm.study import runner
    from tests.study.test_study import TINY

    calls = []

    def counting(tag):
        def measure(run):
            calls.append(tag)
            return {**study_measures.lm(run), "notes": [tag]}
        return measure

    first = dataclasses.replace(TINY, measure=counting("first"))
    second = dataclasses.replace(TINY, name="other", measure=counting("second"))
    runner.run_study(first, tmp_path / "first", size="quick", seeds=1)
    (tmp_path / "second").mkdir()
    for row in ("a", "b"):
        (tmp_path / "second" / row).symlink_to(tmp_path / "first" / row)
    assert runner.run_study(second, tmp_path / "second", size="quick", seeds=1).runs["a"][0].reused
    assert calls == ["first", "first", "second", "second"]
    stored = json.loads((tmp_path / "first" / "a" / "seed-0" / runner.MEASURES_FILE).read_text())
    assert stored["study"] == "tiny" and stored["measures"]["notes"] == ["first"]
    assert stored["others"]["other"]["measures"]["notes"] == ["second"]
    assert stored["others"]["other"]["code"] == runner.measure_fingerprint(second.measure)
    runner.run_study(first, tmp_path / "first", size="quick", seeds=1)
    runner.run_study(second, tmp_path / "second", size="quick", seeds=1)
    assert len(calls) == 4  # both read back from the one file
    shutil.rmtree(tmp_path / "first" / "a" / "seed-0" / "checkpoints")
    (tmp_path / "first" / "a" / "seed-0" / "summary.json").unlink()  # train a again there
    runner.run_study(second, tmp_path / "second", size="quick", seeds=1)
    stored = json.loads((tmp_path / "first" / "a" / "seed-0" / runner.MEASURES_FILE).read_text())
    assert stored["study"] == "other" and "others" not in stored  # the first study's measures were of the old run
