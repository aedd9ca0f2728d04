"""benchmarks/data.py runs and writes its table (tiny sizes: a smoke test, not a measurement)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_data_benchmark_writes_its_table(tmp_path):
    out = tmp_path / "data.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "data.py"), "--megabytes", "0.3", "--num-proc", "1",
         "--bpe-vocab", "300", "--seq-len", "64", "--seconds", "0.2", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert "| byte | 1 |" in text and "| `shards:DIR`" in text and "| pythia-160m |" in text, text
