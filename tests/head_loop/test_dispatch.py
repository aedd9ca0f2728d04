"""Operators a grown SGT model dispatches in one training forward + backward, against the
dense model of the same depth (issue 25): ``benchmarks/train_throughput.py``'s ``dense`` and
``sgt`` variants at d = 64, SGT grown as that benchmark grows it (the 3 deepest layers at
depth 3, half the heads looping). Keeps the count from growing back; no host syncs."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from looplm.accounting.dispatch import count_dispatch

ROOT = Path(__file__).resolve().parents[2]
#: head passes of the grown ``sgt`` variant: 3 layers at depth 3
PASSES = 9
#: operators per head pass beyond dense, forward + backward: measured 25.7 (583 vs dense
#: 352, 1.656x); 30 (622, 1.767x) before q, k, v came from one GEMM, their split and
#: rotation had a hand-written backward and the residual rode on W_O's addmm; 840 (2.31x)
#: when each pass built its indices on the host and gathered its heads' weights. Per pass, so that a cheaper dense
#: block does not move the bound. The issue's 1.40x of dense is below what an eager
#: autograd pass reaches: docs/accounting.md, "Dispatched operators".
PASS_OPS = 26


def _step_counts(name: str, tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_throughput as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    args = bench.parse(["--width", "64", "--seq", "32", "--batch", "2", "--no-compile"])
    model = bench.build(name, args, str(tmp_path / name), False).model
    ids = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(0))

    def step():
        model(ids[:, :-1], ids[:, 1:]).loss.backward()

    step()  # warm: gradients exist from here on, as in training (zeroed to None between steps)
    model.zero_grad(set_to_none=True)
    counts, _ = count_dispatch(step)
    return counts


def test_grown_sgt_head_pass_dispatches_at_most_its_budget(tmp_path):
    dense, sgt = _step_counts("dense", tmp_path), _step_counts("sgt", tmp_path)
    assert sgt.syncs == 0 and dense.syncs == 0, (sgt.by_op, dense.by_op)
    gathers = {op: n for op, n in sgt.by_op.items() if "index" in op or "gather" in op}
    assert not gathers, gathers
    assert sgt.by_op["aten.arange"] <= 1, sgt.by_op  # the forward's position ids only
    assert sgt.ops - dense.ops <= PASSES * PASS_OPS, (
        f"grown SGT {sgt.ops} ops vs dense {dense.ops} ({sgt.ops / dense.ops:.3f}x): "
        f"{(sgt.ops - dense.ops) / PASSES:.1f} per head pass > {PASS_OPS}; "
        f"SGT's extra ops: {sorted((sgt.by_op - dense.by_op).items(), key=lambda kv: -kv[1])}")
