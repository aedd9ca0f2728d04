"""A CPU study's training step three ways, side by side in one run: as is; with transparent
huge pages for PyTorch's allocator (``THP_MEM_ALLOC_ENABLE=1``); and with them and the loss
computed without its logits (``train.loss_rows``, :mod:`looplm.modules.linear_cross_entropy`).

A CPU training step allocates its largest tensors afresh every step (the logits, their
log-softmax and gradients: [batch·seq, vocab], 128 MB each at the stdlib studies' size)
and the kernel faults each in 4 KB pages at first touch: at that size the cross-entropy's
log-softmax, its backward and nll's zero-filled gradient spend most of their time in page
faults. Given this variable before its first allocation, PyTorch's allocator advises
2 MB pages for allocations of 2 MB and more (``madvise(MADV_HUGEPAGE)``; it acts where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``). The same
kernels run on the same values: the loss is checked bit for bit equal. ``loss_rows`` takes
the head's products, the logsumexp and the gradient of the logits a block of rows at a time,
so no [N, V] tensor is written at all; its loss equals the others' to float rounding.

Each setting runs in its own process (the allocator reads the variable once), one thread,
a model built from the study's config and random tokens: forward, backward and AdamW, one
untimed step, then ``--steps`` timed; ``--repeats`` rounds alternate the two settings so
a change in the machine's load hits all alike; a row's time is the median over rounds of
each process's median step.

    python benchmarks/cpu_step.py --out benchmarks/results/cpu-step.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from looplm.study.studies.common import STDLIB_LOSS_ROWS  # noqa: E402  (the rows the stdlib studies use)
from publish import publish  # noqa: E402

ENV = "THP_MEM_ALLOC_ENABLE"
#: row -> (study, size, run): that study row's model and batch, at its size's shared settings
ROWS = {
    "depth-stdlib-fixed-T3": ("depth", "stdlib", "fixed-T3"),
    "depth-stdlib-mor-expert": ("depth", "stdlib", "mor-expert"),
    "mesh-stdlib-mesh": ("mesh", "stdlib", "mesh"),
    "depth-pydoc-fixed-T3": ("depth", "default", "fixed-T3"),
}


def run_config(row: str):
    from looplm.config import load_config
    from looplm.study import get_study

    study, size, run = ROWS[row]
    spec = get_study(study, size).size(size)
    return load_config(spec.runs[run].preset, (*spec.shared, *spec.runs[run].overrides))


def child(row: str, steps: int, loss_rows: int) -> dict:
    """One process: the median seconds of ``steps`` training steps and the last loss."""
    import torch

    from looplm import LoopLM

    torch.set_num_threads(1)
    cfg = run_config(row)
    torch.manual_seed(0)
    model = LoopLM(cfg.model)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.data.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    options = {"loss_rows": loss_rows} if loss_rows else {}

    def step() -> float:
        loss = model(ids[:, :-1], ids[:, 1:], **options).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step()  # untimed: first-touch of the weights' state, lazy initialisation
    times, loss = [], 0.0
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "loss": loss,
            "tokens": cfg.train.batch_size * cfg.data.seq_len, "vocab": cfg.model.vocab_size}


#: setting -> (huge pages, loss_rows)
SETTINGS = {"default": (False, 0), f"`{ENV}=1`": (True, 0),
            f"and `train.loss_rows={STDLIB_LOSS_ROWS}`": (True, STDLIB_LOSS_ROWS)}


def measure(row: str, huge: bool, loss_rows: int, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(ENV, None)
    if huge:
        env[ENV] = "1"
    done = subprocess.run([sys.executable, __file__, "--child", row, "--steps", str(steps),
                           "--loss-rows", str(loss_rows)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def thp_mode() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown (no /sys/kernel/mm/transparent_hugepage)"


def report(rows: list[str], steps: int, repeats: int) -> str:
    import torch

    from looplm.provenance import code_version, cpu_name

    command = shlex.join(["python", "benchmarks/cpu_step.py", *sys.argv[1:]])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = ["# A CPU study's training step: huge pages, the loss without its logits (one thread)", "",
             f"`{command}`; {cpu_name()} ({platform.machine()}), torch {torch.__version__}, looplm "
             f"{code_version()}, fp32, one thread per process; transparent_hugepage: `{thp_mode()}`. "
             f"Each process: one untimed step, then the median of {steps} (forward, backward, AdamW); "
             f"{repeats} rounds alternating the settings, the median over rounds. Load average at the start "
             f"{load:.2f} on {os.cpu_count()} CPUs (other processes slow every setting alike).", "",
             "| row | tokens × vocab per step | " + " | ".join(f"step, {name} (s)" for name in SETTINGS)
             + " | speed-ups | huge pages: loss bit for bit | loss_rows: loss difference |",
             "| --- | --- | " + " | ".join("---" for _ in SETTINGS) + " | --- | --- | --- |"]
    for row in rows:
        runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
        for r in range(repeats):
            for name in (list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]):
                runs[name].append(measure(row, *SETTINGS[name], steps))
        seconds = [statistics.median(x["seconds"] for x in runs[name]) for name in SETTINGS]
        plain, huge, blocked = ([x["loss"] for x in runs[name]] for name in SETTINGS)
        equal = len(set(plain + huge)) == 1
        first = runs["default"][0]
        lines.append(f"| {row} | {first['tokens']} × {first['vocab']} | "
                     + " | ".join(f"{s:.3f}" for s in seconds) + " | "
                     + ", ".join(f"{seconds[0] / s:.2f}×" for s in seconds[1:])
                     + f" | {'yes' if equal else 'NO'} | {max(abs(a - plain[0]) for a in blocked):.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", choices=list(ROWS), help=argparse.SUPPRESS)
    p.add_argument("--loss-rows", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.loss_rows)))
        return
    text = report(args.rows, args.steps, args.repeats)
    publish(text, args.out)


if __name__ == "__main__":
    main()
