"""The benchmark scripts run and write their tables (tiny sizes: a smoke test of the
scripts, not a measurement; the figures live in benchmarks/results/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_train_throughput_core_reports_consistent_numbers(tmp_path):
    """train_throughput.py's figures follow from its measurements: FLOPs/token is the
    accounting module's, tokens/s and MFU come from the step times, each ratio from the rows."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_throughput as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from looplm.accounting import count_flops

    threads = torch.get_num_threads()
    out = tmp_path / "throughput.md"
    argv = ["--width", "32", "--seq", "32", "--batch", "2", "--steps", "1", "--repeats", "1", "--warmup", "1",
            "--no-compile", "--threads", "1", "--peak-flops", "1e11", "--out", str(out)]
    try:
        result = bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    args = bench.parse(argv)
    rows = {r.variant: r for r in result["rows"]}
    assert sorted(rows) == sorted(bench.VARIANTS) and not any(r.compiled for r in rows.values())
    for name, row in rows.items():
        plain = count_flops(bench.run_config(name, args, str(tmp_path), False).model, 32).training_per_token
        if name in ("sgt", "block-loop"):  # grown: the counter charges the extra passes
            assert row.flops_per_token > plain
        else:
            assert row.flops_per_token == plain
        assert row.seconds > 0 and row.tokens_per_s == pytest.approx(2 * 32 / row.seconds)
        assert row.mfu == pytest.approx(row.flops_per_token * row.tokens_per_s / 1e11)
    dense, sgt, spiral, full = rows["dense"], rows["sgt"], rows["spiral"], rows["spiral-full"]
    assert spiral.flops_per_token < full.flops_per_token  # the coarse iterations cost less
    ratios = {(q["target"], q["what"].split()[0]): q for q in result["ratios"]}
    base = ratios[("loop efficiency", "base")]
    assert base["value"] == pytest.approx(rows["base"].flops_per_s / dense.flops_per_s)
    spiral_q = ratios[("SpiralFormer saving", "wall-clock")]
    saving = (1 - spiral.seconds / full.seconds) / (1 - spiral.flops_per_token / full.flops_per_token)
    assert spiral_q["value"] == pytest.approx(saving)
    sgt_q = ratios[("SGT overhead", "step-time")]
    overhead = (sgt.seconds / dense.seconds - 1) / (sgt.flops_per_token / dense.flops_per_token - 1)
    assert sgt_q["value"] == pytest.approx(overhead) and sgt_q["passed"] == (overhead <= 2.0)
    text = out.read_text()
    verdicts = [line for line in text.splitlines() if line.endswith(("| PASS |", "| FAIL |"))]
    assert len(verdicts) == 4, text  # base, mesh, SpiralFormer, SGT
    assert "1.000e+11 FLOP/s (given (--peak-flops))" in text
