"""Grouped-query attention in a decoding step: the cache read in place against the cache
copied to every query head (issue 25; ``ops/grouped_attention.py:attend_grouped``).

One decoding step's attention, q [B, H, 1, D] over a cache of H_kv heads [B, H_kv, S, D]
under a padding mask [B, 1, 1, S] (a batch of prompts of different lengths), three ways:

* ``copies``: K and V repeated to the H query heads, then SDPA: what a masked step did on
  CUDA (SDPA's flash kernel, the one that reads grouped heads, takes no mask);
* ``enable_gqa``: SDPA given the grouped heads and the mask: what a static-cache step did
  (on CUDA SDPA's math kernel, which repeats the cache inside);
* ``folded``: ``attend_grouped``: each group's G query heads folded into the query axis,
  one MHA-shaped call over the cache as it is: what every step does now.

All three compute the same values (checked); the table gives each one's median time and
its ratio to ``copies``, side by side in one run per context length. A step that reads the
cache in place reads it once; the copies write and read it G times.

    python benchmarks/gqa_decode.py --out benchmarks/results/gqa-decode-cpu.md
    python benchmarks/gqa_decode.py --device cuda --dtype bf16 --out benchmarks/results/gqa-decode-cuda.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from looplm.ops.grouped_attention import attend_grouped
from publish import publish

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def copies(q, keys, values, mask):
    G = q.shape[1] // keys.shape[1]
    return F.scaled_dot_product_attention(q, keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1),
                                          attn_mask=mask)


def enable_gqa(q, keys, values, mask):
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


WAYS = {"copies": copies, "enable_gqa": enable_gqa, "folded": attend_grouped}


def inputs(args, context: int):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(B, H, 1, D, generator=g)
    keys, values = torch.randn(B, Hkv, context, D, generator=g), torch.randn(B, Hkv, context, D, generator=g)
    mask = torch.ones(B, 1, 1, context, dtype=torch.bool)
    mask[1:, ..., : context // 4] = False  # the later rows left-padded by a quarter of the context
    dtype = DTYPES[args.dtype]
    return q.to(args.device, dtype), keys.to(args.device, dtype), values.to(args.device, dtype), mask.to(args.device)


def seconds(fn, tensors, args) -> float:
    """Median seconds of ``fn(*tensors)`` after ``args.warmup`` untimed calls, each timed over
    ``args.calls`` calls (the GPU synchronised around them)."""
    cuda = tensors[0].device.type == "cuda"
    times = []
    for i in range(args.warmup + args.repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn(*tensors)
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) / args.calls)
    return statistics.median(times)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def main(argv=None) -> str:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with torch.no_grad():
        for context in args.contexts:
            tensors = inputs(args, context)
            reference = copies(*tensors).float()
            error = max((WAYS[w](*tensors).float() - reference).abs().max().item() for w in ("enable_gqa", "folded"))
            times = {name: seconds(fn, tensors, args) for name, fn in WAYS.items()}
            rows.append((context, times, error))
    device = args.device + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
    lines = [
        "# Grouped-query attention in a decoding step: the cache read in place or copied",
        "",
        f"Command: `python benchmarks/gqa_decode.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
        f"Machine: {platform.machine()}, torch {torch.__version__}, device {device}, {args.dtype}, "
        f"{torch.get_num_threads()} threads. One step's attention: q [{args.batch}, {args.heads}, 1, "
        f"{args.head_dim}] over a cache of {args.kv_heads} heads with a padding mask; per call, median of "
        f"{args.repeats} rounds of {args.calls} calls after {args.warmup} warm-up round(s).",
        "",
        "| context | copies (ms) | enable_gqa (ms) | folded (ms) | enable_gqa / copies | folded / copies | "
        "largest difference |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for context, t, error in rows:
        lines.append(f"| {context} | {t['copies'] * 1e3:.4g} | {t['enable_gqa'] * 1e3:.4g} | {t['folded'] * 1e3:.4g} | "
                     f"{t['enable_gqa'] / t['copies']:.3f} | {t['folded'] / t['copies']:.3f} | {error:.1e} |")
    return publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
