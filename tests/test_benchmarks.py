"""The benchmark scripts run and write their tables (tiny sizes: a smoke test of the
scripts, not a measurement; the figures live in benchmarks/results/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *args: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_mixer_benchmark_writes_its_table(tmp_path):
    out = tmp_path / "mixers.md"
    run("mixers.py", "--kinds", "attention", "gated_deltanet", "--lengths", "64", "--heads", "2",
        "--head-dim", "16", "--repeats", "1", "--threads", "1", "--out", str(out))
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| attention", "| gated_deltanet"))]
    assert len(rows) == 4, text  # training and decode rows of both kinds
    assert "error" not in text, text
    assert "Backend: looplm's PyTorch ops" in text
    pytest.importorskip("fla")
    assert "naive_chunk_gated_delta_rule" in text and "| 64 |" in text


def test_mixer_benchmark_in_process_path():
    """The path CUDA runs take (no subprocess per job), exercised on CPU."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import mixers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    job = dict(what="train", kind="gla", backend="torch", length=32, heads=2, head_dim=16, device="cpu",
               repeats=1, batch=2, dtype="bfloat16")
    result = mixers._measure(dict(job))
    assert result.get("seconds", 0) > 0, result
    decode = {k: v for k, v in job.items() if k != "length"} | {"what": "decode", "context": 32}
    result = mixers._measure(decode)
    assert result.get("seconds", 0) > 0, result


def test_sgt_benchmark_writes_its_table(tmp_path):
    out = tmp_path / "sgt.md"
    run("sgt.py", "--d-model", "32", "--heads", "4", "--layers", "3", "--vocab", "64", "--seq-len", "16",
        "--batch", "2", "--steps", "1", "--warmup", "0", "--max-depth", "2", "--threads", "1", "--out", str(out))
    text = out.read_text()
    assert all(name in text for name in ("vanilla", "block-loop", "sgt-k1", "sgt-k2")), text


def test_long_context_benchmark_writes_its_tables(tmp_path):
    out = tmp_path / "long.md"
    run("long_context.py", "--models", "looped transformer", "GDN+DSA hybrid", "--contexts", "32", "64",
        "--d-model", "32", "--heads", "2", "--new", "2", "--threads", "1", "--out", str(out))
    text = out.read_text()
    assert text.count("| looped transformer |") == 4 and text.count("| GDN+DSA hybrid |") == 4, text
    assert "error" not in text and "OOM" not in text, text
    assert "Decode throughput against the looped transformer at S=64" in text
