"""Mixture-of-Recursions' token skipping: does leaving the loop save wall-clock time?
(arXiv 2507.10524 §2.2.1; issue 27's benchmark, ``model.halting.skip``).

One MoR model (expert choice, top-k selection at the paper's hierarchical capacity: every
position takes step 0, 2/3 of them step 1, 1/3 step 2) trains one step (forward + backward)
with the later steps run on the gathered positions taking them (``skip: true``) and with every
position running every step, those that left frozen (``skip: false``), under both KV policies
that allow skipping (recursion-wise caching and recursive sharing). Both runs hold the same
weights and give the same loss (to float rounding); the table prints the step time of each,
their ratio, and the realised share of block passes (what the FLOP counter charges as realised)
beside it: skipping saves what it should when the time ratio approaches the pass ratio.

    python benchmarks/mor_skip.py --out benchmarks/results/mor-skip-cpu.md
    python benchmarks/mor_skip.py --device cuda --dtype bf16 --d-model 1024 --seq-len 2048 --out ...
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time

import torch

from looplm import LoopLM
from looplm.model_config import ModelConfig
from publish import publish


def build(args, kv: str, skip: bool) -> LoopLM:
    cfg = ModelConfig(
        vocab_size=args.vocab, d_model=args.d_model, n_heads=args.heads, layout=args.layout, norm="rmsnorm",
        mlp="swiglu", bias=False, max_seq_len=args.seq_len, topology={"kind": "anchor"},
        halting={"kind": "mor", "depths": args.depths, "selection": "top_k", "kv": kv, "skip": skip},
    )
    torch.manual_seed(0)
    return LoopLM(cfg).to(args.device).train()


def step_seconds(model: LoopLM, ids: torch.Tensor, args) -> tuple[float, float, float]:
    """(median seconds of a training step after ``args.warmup`` untimed ones, its loss, the
    realised block passes per position)."""
    cuda = ids.device.type == "cuda"
    autocast = (torch.autocast(ids.device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                else contextlib.nullcontext())
    times = []
    for i in range(args.warmup + args.repeats):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            out = model(ids, targets=ids)
        out.loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), out.loss.item(), out.block_passes.float().mean().item()


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--layout", default="1+4R3+1")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.depths = int(args.layout.split("R")[1].split("+")[0])
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    nominal = build(args, "shared", False).cfg.block_passes
    rows = []
    for kv in ("recursion", "shared"):
        measured = {skip: step_seconds(build(args, kv, skip), ids, args) for skip in (False, True)}
        (frozen, frozen_loss, passes), (skipping, loss, _) = measured[False], measured[True]
        rows.append((kv, frozen, skipping, abs(loss - frozen_loss), passes / nominal))
    lines = [
        "# Mixture-of-Recursions: token skipping against the frozen loop",
        "",
        f"Command: `python benchmarks/mor_skip.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
        f"Machine: {platform.machine()}, torch {torch.__version__}, device {args.device}"
        f"{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}, {args.dtype}, "
        f"{torch.get_num_threads()} threads. Model: {args.layout}, anchor topology, d={args.d_model}, "
        f"H={args.heads}, V={args.vocab}, RMSNorm + SwiGLU; MoR expert choice, top-k at the hierarchical "
        f"capacity; batch {args.batch} × {args.seq_len} tokens; one forward + backward, median of "
        f"{args.repeats} after {args.warmup} warm-up step(s).",
        "",
        "| kv | frozen (ms) | skipping (ms) | time ratio | realised / nominal block passes | loss difference |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kv, frozen, skipping, diff, share in rows:
        lines.append(f"| {kv} | {frozen * 1e3:.1f} | {skipping * 1e3:.1f} | {skipping / frozen:.3f} | "
                     f"{share:.3f} | {diff:.1e} |")
    return publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
