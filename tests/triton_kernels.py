"""Shared by the tests of looplm's Triton kernels: where they run (CUDA when there is one,
else CPU under ``TRITON_INTERPRET=1``), and the test that re-runs a kernel test file under
the interpreter in a child process (the interpreter must be chosen before triton compiles
anything, so it cannot be switched on inside a running process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
runs_kernels = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED, reason="needs CUDA or TRITON_INTERPRET=1")
#: marks the test that runs its file under the interpreter (pointless where the kernels already run)
reruns_interpreted = pytest.mark.skipif(INTERPRETED or DEVICE == "cuda", reason="already running the kernels")


def run_interpreted(path: str, skipped: int) -> None:
    """Run the tests of ``path`` under ``TRITON_INTERPRET=1`` in a child process: all must
    pass, ``skipped`` of them skip (the re-running test itself, CUDA-only ones)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", path],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.splitlines()[-1].split(" in ")[0]
    assert "failed" not in summary and summary.endswith(f"passed, {skipped} skipped"), run.stdout
