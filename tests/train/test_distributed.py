"""DistributedDataParallel on CPU (gloo): two ranks equal one process with the global batch."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from looplm.train import Trainer, read_metrics, train_losses
from tests.train.helpers import run_config

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

KW = dict(topology="mesh", grad_accum=2, max_steps=4, save_every=2, eval_every=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, stop_after, resume: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        cfg = run_config(out_dir, batch_size=2, **KW)  # 2 sequences per rank: a global batch of 4
        Trainer(cfg, resume=resume, progress=False).fit(stop_after=stop_after)
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one_process_and_resume(tmp_path):
    out = str(tmp_path / "ddp")
    mp.spawn(_worker, args=(2, _free_port(), out, 2, False), nprocs=2)
    mp.spawn(_worker, args=(2, _free_port(), out, None, True), nprocs=2)  # every rank loads the checkpoint
    Trainer(run_config(tmp_path / "single", batch_size=4, **KW), progress=False).fit()

    ddp, single = train_losses(tmp_path / "ddp" / "metrics.jsonl"), train_losses(tmp_path / "single" / "metrics.jsonl")
    assert sorted(ddp) == sorted(single) == [1, 2, 3, 4]
    for step in single:  # same data and gradients; only the reduction order differs
        assert ddp[step] == pytest.approx(single[step], rel=1e-5)
    val = {e["step"]: e["val_loss"] for e in read_metrics(tmp_path / "ddp" / "metrics.jsonl") if e["event"] == "eval"}
    val_single = {e["step"]: e["val_loss"] for e in read_metrics(tmp_path / "single" / "metrics.jsonl")
                  if e["event"] == "eval"}
    assert val.keys() == val_single.keys() == {2, 4}
    assert val[4] == pytest.approx(val_single[4], rel=1e-5)


def test_torchrun_launches_the_cli_with_ddp(tmp_path):
    """`torchrun -m looplm.cli train ...`: the CLI sets up the process group from the env."""
    import json
    import subprocess
    import sys

    out = tmp_path / "torchrun"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", "-m", "looplm.cli", "train", "tiny-base", f"train.out_dir={out}",
        "train.max_steps=2", "train.batch_size=2", "train.eval_every=0", "train.sample_tokens=4",
        "model.d_model=32", "data.seq_len=32", "train.device=cpu", "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert summary["tokens_seen"] == 2 * 2 * 2 * 32  # steps x ranks x batch x seq_len
