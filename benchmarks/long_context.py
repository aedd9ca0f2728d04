"""Whole looped models against context length: prefill and decode throughput, peak memory.

The shape of LT2's efficiency figure (lt2.txt §5, "Efficiency"): for a looped transformer,
a looped Gated DeltaNet, the Full+GDN hybrid (one attention layer in five) and the
GDN+DSA hybrid (one GDN layer in five, DSA elsewhere), all at the same width and layout
(LT2's tiny presets widened by ``--d-model``), in one run:

* prefill: one cached forward over a prompt of S tokens, batch B: tokens/s = B·S / time;
* decode: ``--new`` single-token steps after that prefill, each timed alone: tokens/s =
  B / the median step time (the median ignores the first step, which moves the prefilled
  cache into buffers with spare rows, and steps a loaded machine preempted). The linear
  mixers' state is constant-size, so their decode throughput should not fall with S;
  attention's reads all S keys per step; DSA scores the indexer's one small key per
  position and then reads only its top-k keys and values;
* peak memory of prefill + decode, measured in a fresh subprocess per cell with glibc's
  mmap threshold fixed (see benchmarks/mixers.py for why), on CUDA torch's allocator
  peak. A cell that runs out of memory is marked ``OOM``.

``--clock process`` times with this process's CPU time instead of the wall clock: on a
machine shared with other jobs (and ``--threads 1``) it leaves out the time the process
waited for a core. ``--profile MODEL`` adds where that model's decode step spends its
time at the longest context: per component (forward hooks on every block's mixer, by kind,
and FFN) and the top operators of ``torch.profiler``.

The last table gives the ratio of each model's decode throughput to the looped
transformer's at the longest context (LT2 reports 5.7x for GDN+DSA at 8k, batch 8, H100).

    python benchmarks/long_context.py --threads 2
    python benchmarks/long_context.py --threads 1 --clock process --profile "GDN+DSA hybrid"
    python benchmarks/long_context.py --device cuda --contexts 4096 8192 16384 32768 --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
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


def _clock(job: dict):
    return time.process_time if job.get("clock") == "process" else time.perf_counter


@torch.no_grad()
def measure(job: dict) -> dict:
    """Prefill and decode of one model at one context length; times in seconds."""
    from looplm.cache import LoopCache

    torch.manual_seed(0)
    device, clock = job["device"], _clock(job)
    model = build(job["model"], job["d_model"], job["heads"], job["context"] + job["new"] + PROFILE_STEPS, device)
    prompt = torch.randint(0, 256, (job["batch"], job["context"]), device=device)
    steps = torch.randint(0, 256, (job["batch"], job["new"] + PROFILE_STEPS), device=device)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        cache = LoopCache()
        _sync(device)
        start = clock()
        model(prompt, cache=cache)
        _sync(device)
        prefill = clock() - start
        step_times = []
        for i in range(job["new"]):
            start = clock()
            model(steps[:, i:i + 1], cache=cache)
            _sync(device)
            step_times.append(clock() - start)
    except torch.OutOfMemoryError:
        return {"oom": True}
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda")
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)  # KiB on Linux
    tokens = job["batch"]
    result = {"prefill_tok_s": tokens * job["context"] / prefill,
              "decode_tok_s": tokens / statistics.median(step_times), "peak_mib": peak}
    if job.get("profile"):
        result["profile"] = profile_decode(model, cache, steps[:, job["new"]:], clock, device)
    return result


#: decode steps profiled after the timed ones (``--profile``)
PROFILE_STEPS = 8


def profile_decode(model, cache, steps: torch.Tensor, clock, device: str) -> dict:
    """Where decode steps spend their time: seconds per step in every block's mixer (by
    class) and FFN, measured by forward hooks, the rest of the step, and the top operators
    of torch.profiler by self time (ms per step)."""
    spent: dict[str, float] = {}
    started: dict[int, float] = {}

    def enter(module, args):
        _sync(device)
        started[id(module)] = clock()

    def leave(label):
        def hook(module, args, output):
            _sync(device)
            spent[label] = spent.get(label, 0.0) + clock() - started.pop(id(module))
        return hook

    handles = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("attn", "ffn"):
            label = f"mixer {type(module).__name__}" if leaf == "attn" else "FFN"
            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave(label))]
    n = steps.shape[1] // 2
    total = 0.0
    try:
        for i in range(n):
            start = clock()
            model(steps[:, i:i + 1], cache=cache)
            _sync(device)
            total += clock() - start
    finally:
        for handle in handles:
            handle.remove()
    parts = {label: t / n for label, t in sorted(spent.items(), key=lambda kv: -kv[1])}
    parts["rest (embedding, norms, loop topology, head, cache bookkeeping)"] = (total - sum(spent.values())) / n

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for i in range(n, steps.shape[1]):
            model(steps[:, i:i + 1], cache=cache)
        _sync(device)
    m = steps.shape[1] - n
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return {"step_s": total / n, "parts": parts,
            "ops": [(e.key, e.self_cpu_time_total / 1000 / m, e.count // m) for e in ops]}


def run_job(args: argparse.Namespace, **job) -> dict:
    """On CPU in a fresh subprocess (its own peak memory); on CUDA in this process."""
    job = {**job, "device": args.device, "batch": args.batch, "new": args.new, "d_model": args.d_model,
           "heads": args.heads, "clock": args.clock}
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
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="wall clock, or this process's CPU time (a shared machine; --threads 1)")
    parser.add_argument("--profile", default=None, choices=list(MODELS), metavar="NAME",
                        help="also report where this model's decode step spends its time at the longest context")
    parser.add_argument("--note", default=None, help="a paragraph added to the results (e.g. the machine's load)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child is not None:
        print(json.dumps(measure(json.loads(args.child))))
        return

    if args.profile and args.profile not in args.models:
        parser.error(f"--profile {args.profile!r}: not among --models")
    longest = args.contexts[-1]
    results = {(m, s): run_job(args, model=m, context=s, profile=(m == args.profile and s == longest))
               for m in args.models for s in args.contexts}
    contexts = " | ".join(f"S={s}" for s in args.contexts)
    rule = " | ".join("---" for _ in args.contexts)
    command = shlex.join(["python", "benchmarks/long_context.py", *sys.argv[1:]])
    lines = [
        "# Long context: whole looped models, prefill and decode",
        "",
        f"Command: `{command.strip()}`  ",
        f"Machine: {platform.machine()}, torch {torch.__version__}, {args.threads} threads, device {args.device}; "
        f"batch {args.batch}, d_model {args.d_model}, {args.heads} heads, layout 5R2 (LT2 tiny presets widened), "
        f"{args.new} decode steps (tokens/s from the median step), {args.clock} clock.",
        "",
    ]
    if args.note:
        lines += [args.note, ""]
    for title, key, fmt in (("Prefill: tokens/s", "prefill_tok_s", "{:,.0f}"),
                            ("Decode: tokens/s", "decode_tok_s", "{:,.1f}"),
                            ("Peak memory of prefill + decode: MiB", "peak_mib", "{:,.0f}")):
        lines += [f"## {title}", "", f"| model | {contexts} |", f"| --- | {rule} |"]
        lines += [f"| {m} | " + " | ".join(cell(results[m, s], key, fmt) for s in args.contexts) + " |"
                  for m in args.models]
        lines.append("")
    base = "looped transformer"
    if base in args.models and "decode_tok_s" in results[base, longest]:
        lines += [f"## Decode throughput against the looped transformer at S={longest}", "",
                  "| model | ratio |", "| --- | --- |"]
        for m in args.models:
            r = results[m, longest]
            ratio = f"{r['decode_tok_s'] / results[base, longest]['decode_tok_s']:.2f}x" if "decode_tok_s" in r else "-"
            lines.append(f"| {m} | {ratio} |")
        lines.append("")
    profiled = results.get((args.profile, longest), {}).get("profile")
    if profiled:
        lines += [f"## Where a {args.profile} decode step spends its time at S={longest}", "",
                  f"One step: {profiled['step_s'] * 1000:.2f} ms ({args.clock} clock, mean of "
                  f"{PROFILE_STEPS // 2} steps; forward hooks, so the per-call hook cost is in the parts).", "",
                  "| part | ms per step | share |", "| --- | --- | --- |"]
        lines += [f"| {part} | {t * 1000:.2f} | {t / profiled['step_s']:.0%} |"
                  for part, t in profiled["parts"].items()]
        lines += ["", "Top operators by self time (torch.profiler, wall clock):", "",
                  "| operator | ms per step | calls per step |", "| --- | --- | --- |"]
        lines += [f"| `{name}` | {ms:.2f} | {calls} |" for name, ms, calls in profiled["ops"]]
        lines.append("")
    out = Path(args.out or f"benchmarks/results/long-context-{args.device.split(':')[0]}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, out)  # atomic: a reader sees the old results or the new ones
    print("\n".join(lines))


if __name__ == "__main__":
    main()
