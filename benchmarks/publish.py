"""Where a benchmark's report goes: to stdout, and whole to ``--out`` when one is named.

Every script here ends with a Markdown report; those that run under a deadline
(``benchmarks/gpu.sh``) write it again after each measured row, so a run cut short keeps
what it measured. The file is replaced atomically (``looplm.artifacts.write_text``): a
reader sees the last complete report, never half of one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Union

from looplm.artifacts import write_text


def publish(text: str, out: Optional[Union[str, os.PathLike]], echo: bool = True) -> str:
    """Write ``text`` to ``out`` (its folder made; None or "": nowhere) and, with ``echo``,
    to stdout. Returns ``text``."""
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, text, atomic=True)
    if echo:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    return text
