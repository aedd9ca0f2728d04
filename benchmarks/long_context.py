"""Whole looped models against context length: prefill and decode throughput, peak memory.

The shape of LT2's efficiency figure (lt2.txt §5, "Efficiency"): for a looped transformer,
a looped Gated DeltaNet, the Full+GDN hybrid (one attention layer in five) and the
GDN+DSA hybrid (one GDN layer in five, DSA elsewhere), all at the same width and layout
(LT2's tiny presets widened by ``--d-model``), in one run:

* prefill: one cached forward over a prompt of S tokens, batch B: tokens/s = B·S / time;
* decode: ``--new`` single-token steps after that prefill: tokens/s = B·new / time. The
  linear mixers' state is constant-size, so their decode throughput should not fall with
  S; attention's reads all S keys per step; DSA reads the indexer's small keys for every
  position and then only its top-k keys and values;
* peak memory of prefill + decode, measured in a fresh subprocess per cell with glibc's
  mmap threshold fixed (see benchmarks/mixers.py for why), on CUDA torch's allocator
  peak. A cell that runs out of memory is marked ``OOM``.

The last table gives the ratio of each model's decode throughput to the looped
transformer's at the longest context (LT2 reports 5.7x for GDN+DSA at 8k, batch 8, H100).

    python benchmarks/long_context.py --threads 2
    python benchmarks/long_context.py --device cuda --contexts 4096 8192 16384 32768 --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

MODELS = {  # name -> (preset, extra overrides)
    "looped transformer": ("tiny-lt2-transformer", []),
    "looped GDN": ("tiny-lt2-gdn", []),
    "Full+GDN hybrid": ("tiny-lt2-hybrid-full-gdn", []),
    "GDN+DSA hybrid": ("tiny-lt2-hybrid-gdn-dsa", ["model.mixer.top_k=256", "model.mixer.index_head_dim=64"]),
}
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192)
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def build(name: str, d_model: int, heads: int, max_len: int, device: str):
    from looplm import LoopLM, load_config

    preset, extra = MODELS[name]
    cfg = load_config(preset, [f"model.d_model={d_model}", f"model.n_heads={heads}", f"model.max_seq_len={max_len}",
                               *extra]).model
    return LoopLM(cfg).to(device).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def measure(job: dict) -> dict:
    """Prefill and decode of one model at one context length; times in seconds."""
    from looplm.cache import LoopCache

    torch.manual_seed(0)
    device = job["device"]
    model = build(job["model"], job["d_model"], job["heads"], job["context"] + job["new"], device)
    prompt = torch.randint(0, 256, (job["batch"], job["context"]), device=device)
    steps = torch.randint(0, 256, (job["batch"], job["new"]), device=device)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        cache = LoopCache()
        _sync(device)
        start = time.perf_counter()
        model(prompt, cache=cache)
        _sync(device)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(job["new"]):
            model(steps[:, i:i + 1], cache=cache)
        _sync(device)
        decode = time.perf_counter() - start
    except torch.OutOfMemoryError:
        return {"oom": True}
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda")
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)  # KiB on Linux
    tokens = job["batch"]
    return {"prefill_tok_s": tokens * job["context"] / prefill, "decode_tok_s": tokens * job["new"] / decode,
            "peak_mib": peak}


def run_job(args: argparse.Namespace, **job) -> dict:
    """On CPU in a fresh subprocess (its own peak memory); on CUDA in this process."""
    job = {**job, "device": args.device, "batch": args.batch, "new": args.new, "d_model": args.d_model,
           "heads": args.heads}
    if args.device.startswith("cuda"):
        return measure(job)
    cmd = [sys.executable, __file__, "--child", json.dumps(job), "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **FIXED_MMAP_THRESHOLD})
    if done.returncode != 0:
        out_of_memory = "MemoryError" in done.stderr or done.returncode == -9
        return {"oom": True} if out_of_memory else {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def cell(result: dict, key: str, fmt: str) -> str:
    if result.get("oom"):
        return "OOM"
    if "error" in result:
        return "error"
    return fmt.format(result[key])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS), metavar="NAME")
    parser.add_argument("--contexts", nargs="*", type=int, default=list(DEFAULT_CONTEXTS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=16, help="decode steps after the prefill")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child is not None:
        print(json.dumps(measure(json.loads(args.child))))
        return

    results = {(m, s): run_job(args, model=m, context=s) for m in args.models for s in args.contexts}
    contexts = " | ".join(f"S={s}" for s in args.contexts)
    rule = " | ".join("---" for _ in args.contexts)
    command = "python benchmarks/long_context.py " + " ".join(sys.argv[1:])
    lines = [
        "# Long context: whole looped models, prefill and decode",
        "",
        f"Command: `{command.strip()}`  ",
        f"Machine: {platform.machine()}, torch {torch.__version__}, {args.threads} threads, device {args.device}; "
        f"batch {args.batch}, d_model {args.d_model}, {args.heads} heads, layout 5R2 (LT2 tiny presets widened), "
        f"{args.new} decode steps.",
        "",
    ]
    for title, key, fmt in (("Prefill: tokens/s", "prefill_tok_s", "{:,.0f}"),
                            ("Decode: tokens/s", "decode_tok_s", "{:,.1f}"),
                            ("Peak memory of prefill + decode: MiB", "peak_mib", "{:,.0f}")):
        lines += [f"## {title}", "", f"| model | {contexts} |", f"| --- | {rule} |"]
        lines += [f"| {m} | " + " | ".join(cell(results[m, s], key, fmt) for s in args.contexts) + " |"
                  for m in args.models]
        lines.append("")
    longest, base = args.contexts[-1], "looped transformer"
    if base in args.models and "decode_tok_s" in results[base, longest]:
        lines += [f"## Decode throughput against the looped transformer at S={longest}", "",
                  "| model | ratio |", "| --- | --- |"]
        for m in args.models:
            r = results[m, longest]
            ratio = f"{r['decode_tok_s'] / results[base, longest]['decode_tok_s']:.2f}x" if "decode_tok_s" in r else "-"
            lines.append(f"| {m} | {ratio} |")
        lines.append("")
    out = Path(args.out or f"benchmarks/results/long-context-{args.device.split(':')[0]}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
