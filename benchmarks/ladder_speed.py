"""How long the paper-size ladder takes: each rung's training step, timed (issue 25's target:
a rung of 5000 steps in under 2 minutes on one GPU, so all seven fit in 15 minutes).

Each rung of the compute-placement ladder (autoregressive-trm.txt Table 1, App. B) at the
paper's size (``looplm study ladder --paper``: C = 24 block passes, d = 384, 6 heads,
L_train = 10, batch 64, addition) is built as the study builds it, trained ``--warmup``
untimed steps (compilation, CUDA-graph recording) and ``--steps`` timed ones; the table
gives the step time, the projected time of 5000 steps (training only: the study's
evaluations come on top) and the first step's seconds. Rows are written as they finish.

    python benchmarks/ladder_speed.py --device cuda --compile reduce-overhead \\
        --out benchmarks/results/ladder-speed-cuda.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from looplm.ladder import RUNGS
from looplm.ladder.runner import ladder_configs
from looplm.train import Trainer
from publish import publish

#: the study's paper size (looplm.study.studies.ladder._LADDER_PAPER) without evaluation or checkpoints
PAPER = ("model.d_model=384", "model.n_heads=6", "data.task.train_length=10", "data.task.min_length=10",
         "data.seq_len=33", "train.batch_size=64", "train.lr=3e-4", "train.eval_every=0", "train.save_every=0",
         "train.sample_tokens=0")
STEPS, TARGET_S = 5000, 120.0


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rungs", nargs="+", default=list(RUNGS), choices=RUNGS)
    p.add_argument("--budget", type=int, default=24, help="C, block passes per forward")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", default="reduce-overhead",
                   help="train.compile: false, true or a torch.compile mode (default reduce-overhead)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--override", nargs="*", default=[], help="more key=value (e.g. model.d_model=32 on CPU)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse(argv)
    compile_value = {"false": "false", "true": "true"}.get(args.compile.lower(), args.compile)
    lines = [
        "# Paper-size ladder: training step time per rung",
        "",
        f"Command: `python benchmarks/ladder_speed.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
        f"Device {args.device}{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}, "
        f"torch {torch.__version__}; train.compile={compile_value}; addition, C = {args.budget}, "
        f"{' '.join(PAPER[:3])} batch 64 unless overridden ({' '.join(args.override) or 'none'}); median of "
        f"{args.steps} timed steps after {args.warmup} warm-up step(s). Target: {STEPS} steps in under "
        f"{TARGET_S:.0f} s per rung.",
        "",
        "| rung | step (ms) | 5000 steps (s) | within 2 min | first step (s) |",
        "| --- | ---: | ---: | --- | ---: |",
    ]
    rows = []

    def write() -> None:
        publish("\n".join(lines) + "\n", args.out, echo=False)

    write()
    with tempfile.TemporaryDirectory() as tmp:
        for rung in args.rungs:
            overrides = [*PAPER, f"train.device={args.device}", f"train.compile={compile_value}", *args.override]
            cfg = ladder_configs("addition", args.budget, tmp, rungs=[rung], overrides=overrides)[rung]
            trainer = Trainer(cfg, progress=False)
            start = time.perf_counter()
            trainer.train_step()
            first = time.perf_counter() - start
            for _ in range(args.warmup - 1):
                trainer.train_step()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                trainer.train_step()  # reads the loss back: synchronises the device
                times.append(time.perf_counter() - start)
            step = sorted(times)[len(times) // 2]
            rows.append({"rung": rung, "step_s": step, "projected_s": step * STEPS, "first_s": first})
            lines.append(f"| {rung} | {step * 1e3:.1f} | {step * STEPS:.0f} | "
                         f"{'yes' if step * STEPS <= TARGET_S else 'no'} | {first:.1f} |")
            print(lines[-1], flush=True)
            write()
            del trainer
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
