"""Which code produced a result: looplm's version and the git commit it was run from.

A training run records it in every session's first metrics.jsonl event (``start`` or
``resume``), so a table made later from many runs can say which commits trained them and
flag any trained from a working tree with uncommitted changes to looplm's code, whose commit
does not reproduce its numbers. Only the package's own files and ``pyproject.toml`` (its
dependency pins) count: a README edit, or the tables and run records a study writes under
``docs/results``, change nothing a run computes.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DIRTY = "-dirty"


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """``"<version> (git <commit>)"`` of this looplm, e.g. ``0.1.0 (git 336d443-dirty)``; the
    version alone where looplm does not run from a git checkout (an installed wheel). Read
    once per process: the code a process runs is the code it loaded."""
    try:
        text = version("looplm")
    except PackageNotFoundError:
        text = "unknown"
    commit = git_commit(Path(__file__).parent)
    return text + (f" (git {commit})" if commit else "")


def git_commit(package: Path) -> str | None:
    """The commit of the checkout holding ``package`` (``git describe --always``), with
    ``-dirty`` when the package's files or the ``pyproject.toml`` beside its source root
    differ from it (modified, staged or untracked); None outside a git checkout."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=package, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = (git("describe", "--always") or "").strip()
    if not commit:
        return None
    changes = git("status", "--porcelain", "--", ".", str(package.parent.parent / "pyproject.toml"))
    return commit + (DIRTY if changes is None or changes.strip() else "")


@functools.lru_cache(maxsize=None)
def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s model name, else the platform's): a run's numbers
    depend on it at float rounding (its kernels' order of summation), so a session records it
    beside its code."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def is_dirty(code: str) -> bool:
    """Whether a :func:`code_version` string names a working tree with uncommitted changes."""
    return DIRTY in code
