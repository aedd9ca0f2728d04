"""Which code produced a result: looplm's version and the git commit it was run from.

A training run records it in every session's first metrics.jsonl event (``start`` or
``resume``), so a table made later from many runs can say which commits trained them and
flag any trained from a working tree with uncommitted changes, whose commit does not
reproduce its numbers (``git describe --dirty``).
"""

from __future__ import annotations

import functools
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DIRTY = "-dirty"


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """``"<version> (git <describe>)"`` of this looplm, e.g. ``0.1.0 (git 336d443-dirty)``; the
    version alone where looplm does not run from a git checkout (an installed wheel)."""
    try:
        text = version("looplm")
    except PackageNotFoundError:
        text = "unknown"
    try:
        described = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).parent,
                                   capture_output=True, text=True, timeout=5)
        if described.returncode == 0 and described.stdout.strip():
            text += f" (git {described.stdout.strip()})"
    except (OSError, subprocess.SubprocessError):
        pass
    return text


def is_dirty(code: str) -> bool:
    """Whether a :func:`code_version` string names a working tree with uncommitted changes."""
    return DIRTY in code
