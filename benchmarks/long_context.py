"""Whole looped models against context length: prefill and decode throughput, peak memory.

The shape of LT2's efficiency figure (lt2.txt §5, "Efficiency"): for a looped transformer,
a looped Gated DeltaNet, the Full+GDN hybrid (one attention layer in five) and the
GDN+DSA hybrid (one GDN layer in five, DSA elsewhere), at one shape, in one run:

* ``--shape tiny`` (default): LT2's tiny presets (layout 5R2, 10 block passes per token)
  widened by ``--d-model`` / ``--heads``;
* ``--shape lt2-0.6b``: the paper's looped 0.6B models, the ``lt2-0.6b-*`` presets (d_model
  1024, 16 heads, 25R4 for the transformer and looped GDN, 21R4 for the hybrids, DSA with
  top-k 2048 and a 64-head indexer of dim 128, vocabulary 128,256), where reading the
  attention caches dominates a decode step.

Measured per model and context S, batch B:

* prefill: one cached forward over a prompt of S tokens: tokens/s = B·S / time;
* decode, ``--decode-via cache`` (default without ``--compile``): ``--new`` single-token
  steps through the cache API after that prefill, each timed alone: tokens/s = B / the
  median step time (the median ignores steps a loaded machine preempted). The linear
  mixers' state is constant-size, so their decode throughput should not fall with S;
  attention's reads all S keys per step; DSA scores the indexer's one small key per
  position and then reads only its top-k keys and values;
* decode, ``--decode-via generate`` (implied by ``--compile``, which passes
  ``compile=True``: the captured decode step; ``--compile cuda-graph`` passes
  ``compile="cuda-graph"``: the eager step recorded as CUDA graphs): greedy ``model.generate`` of 1 and of
  1 + ``--new`` tokens; prefill tokens/s = B·S / the first call's time, decode tokens/s =
  B·new / the difference (the decode steps alone, ``generate``'s own per-token work
  included);
* peak memory of prefill + decode, measured in a fresh subprocess per cell with glibc's
  mmap threshold fixed (see benchmarks/mixers.py for why), on CUDA torch's allocator
  peak. A cell that runs out of memory is marked ``OOM``.

Every cell first runs untimed what it then times: a full prefill of the same shape and
``WARMUP_STEPS`` decode steps on a fresh cache (through the cache API), or the same two
``generate`` calls; so Triton's autotuning, CUDA's start-up and ``torch.compile`` are never
in a figure. ``--dtype`` (bf16 by default on CUDA, fp32 on CPU): bf16 casts the model's
parameters (``model.to(torch.bfloat16)``, as an inference engine holds them; no autocast,
which would cast every weight again at every step), so activations and caches are bf16.
On CUDA the cells run in this process, one model at a time (built once for all its
contexts), and the results file is rewritten after every cell, so a run stopped at a
deadline keeps what it measured.

``--clock process`` times with this process's CPU time instead of the wall clock: on a
machine shared with other jobs (and ``--threads 1``) it leaves out the time the process
waited for a core. ``--profile MODEL`` adds where that model's decode step spends its
time at the longest context: per component (forward hooks on every block's mixer, by kind,
and FFN) and the top operators of ``torch.profiler``.

The last table gives the ratio of each model's decode throughput to the looped
transformer's at the longest context (LT2 reports 5.7x for GDN+DSA at 8k, batch 8, H100),
and each model's decode rate at the longest context over its rate at the shortest.

    python benchmarks/long_context.py --threads 2
    python benchmarks/long_context.py --threads 1 --clock process --profile "GDN+DSA hybrid"
    python benchmarks/long_context.py --device cuda --shape lt2-0.6b --contexts 2048 8192 --batch 8 --compile
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from publish import publish

#: shape -> model name -> (preset, extra overrides); the same four models in each shape
SHAPES = {
    "tiny": {
        "looped transformer": ("tiny-lt2-transformer", []),
        "looped GDN": ("tiny-lt2-gdn", []),
        "Full+GDN hybrid": ("tiny-lt2-hybrid-full-gdn", []),
        "GDN+DSA hybrid": ("tiny-lt2-hybrid-gdn-dsa", ["model.mixer.top_k=256", "model.mixer.index_head_dim=64"]),
    },
    "lt2-0.6b": {
        "looped transformer": ("lt2-0.6b-transformer", []),
        "looped GDN": ("lt2-0.6b-gdn", []),
        "Full+GDN hybrid": ("lt2-0.6b-hybrid-full-gdn", []),
        "GDN+DSA hybrid": ("lt2-0.6b-hybrid-gdn-dsa", []),
    },
}
MODELS = list(SHAPES["tiny"])
TINY_WIDTH = {"d_model": 256, "heads": 4}  # --d-model / --heads defaults (tiny shape only)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192)
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
#: untimed decode steps after the untimed prefill of every cell (``--decode-via cache``)
WARMUP_STEPS = 3


def model_config(shape: str, name: str, max_len: int, d_model: int | None = None, heads: int | None = None):
    """The ModelConfig of one benchmarked model: its preset, widened (tiny shape only), with
    ``max_seq_len`` covering prompt + decoded tokens."""
    from looplm import load_config

    preset, extra = SHAPES[shape][name]
    width = [f"model.d_model={d_model}", f"model.n_heads={heads}"] if shape == "tiny" else []
    return load_config(preset, [*width, f"model.max_seq_len={max_len}", *extra]).model


def build(job: dict, max_len: int):
    """The job's model on its device in its dtype, eval mode, weights from seed 0."""
    from looplm import LoopLM

    torch.manual_seed(0)
    cfg = model_config(job["shape"], job["model"], max_len, job["d_model"], job["heads"])
    with torch.device(job["device"]):  # initialised on the device: a 0.6B model's CPU init is slow
        model = LoopLM(cfg)
    return model.to(job["device"], DTYPES[job["dtype"]]).eval()


def max_len_for(context: int, new: int) -> int:
    """Positions a cell needs: prompt, warm-up or timed decode steps, profiled steps, one spare."""
    return context + new + max(WARMUP_STEPS, PROFILE_STEPS) + 1


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _clock(job: dict):
    return time.process_time if job.get("clock") == "process" else time.perf_counter


@torch.no_grad()
def measure(job: dict, model=None) -> dict:
    """Prefill and decode of one model at one context length (``model`` built for it when
    None); throughputs in tokens/s, peak memory in MiB."""
    device = job["device"]
    model = build(job, max_len_for(job["context"], job["new"])) if model is None else model
    torch.manual_seed(0)
    prompt = torch.randint(0, 256, (job["batch"], job["context"]), device=device)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        timed = through_generate if job["decode_via"] == "generate" else through_cache
        result = timed(model, prompt, job)
    except torch.OutOfMemoryError:
        return {"oom": True}
    result["peak_mib"] = (torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda")
                          else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)  # KiB on Linux
    return result


def through_cache(model, prompt: torch.Tensor, job: dict) -> dict:
    """Prefill, then ``job['new']`` single steps through the cache API, each timed alone;
    an identical untimed prefill and ``WARMUP_STEPS`` steps on a fresh cache first."""
    from looplm.cache import LoopCache

    device, clock = job["device"], _clock(job)
    steps = torch.randint(0, 256, (prompt.shape[0], job["new"] + PROFILE_STEPS), device=device)
    warm = LoopCache()
    model(prompt, cache=warm)
    for i in range(WARMUP_STEPS):
        model(steps[:, i:i + 1], cache=warm)
    _sync(device)
    del warm

    cache = LoopCache()
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
    tokens = prompt.shape[0]
    result = {"prefill_tok_s": tokens * prompt.shape[1] / prefill, "decode_tok_s": tokens / statistics.median(step_times)}
    if job.get("profile"):
        result["profile"] = profile_decode(model, cache, steps[:, job["new"]:], clock, device)
    return result


def through_generate(model, prompt: torch.Tensor, job: dict) -> dict:
    """Greedy ``model.generate`` of 1 and of 1 + ``job['new']`` tokens (``compile=True`` when
    the job compiles), both calls run once untimed first, then each timed ``job['repeats']``
    times, the fastest kept: prefill from the first call, decode from the difference."""
    device, clock = job["device"], _clock(job)
    options = {"compile": job["compile"]} if job["compile"] else {}
    generate = functools.partial(model.generate, temperature=0.0, **options)

    def seconds(new_tokens: int) -> float:
        _sync(device)
        start = clock()
        generate(prompt, max_new_tokens=new_tokens)
        _sync(device)
        return clock() - start

    seconds(1), seconds(1 + job["new"])  # warm-up at both cache sizes: compilation, autotuning
    repeats = job.get("repeats", 1)  # the fastest of each: a loaded machine only adds time
    first = min(seconds(1) for _ in range(repeats))
    full = min(seconds(1 + job["new"]) for _ in range(repeats))
    if full <= first:
        return {"error": f"decode time not measurable: {1 + job['new']} tokens took {full:.4f} s, 1 took {first:.4f} s"}
    tokens = prompt.shape[0]
    return {"prefill_tok_s": tokens * prompt.shape[1] / first, "decode_tok_s": tokens * job["new"] / (full - first)}


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


def run_job(args: argparse.Namespace, built=None, **job) -> dict:
    """On CPU in a fresh subprocess (its own peak memory); on CUDA in this process, on the
    ``built`` model (an exception becomes the cell's error, so later cells still run)."""
    job = {**job, **job_options(args)}
    if in_process(args):
        try:
            return measure(job, built)
        except Exception as error:  # noqa: BLE001 - one failing cell must not end the run
            traceback.print_exc()
            return {"error": f"{type(error).__name__}: {error}".splitlines()[0]}
        finally:
            torch.cuda.empty_cache()
    cmd = [sys.executable, __file__, "--child", json.dumps(job), "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **FIXED_MMAP_THRESHOLD})
    if done.returncode != 0:
        out_of_memory = "MemoryError" in done.stderr or done.returncode == -9
        return {"oom": True} if out_of_memory else {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def job_options(args: argparse.Namespace) -> dict:
    """What every cell of this run shares."""
    return {"device": args.device, "batch": args.batch, "new": args.new, "shape": args.shape, "d_model": args.d_model,
            "heads": args.heads, "clock": args.clock, "dtype": args.dtype, "decode_via": args.decode_via,
            "compile": args.compile, "repeats": args.repeats}


def in_process(args: argparse.Namespace) -> bool:
    return args.device.startswith("cuda")


def cell(result: dict | None, key: str, fmt: str) -> str:
    if result is None:
        return "…"  # not measured (yet): a run stopped at its deadline
    if result.get("oom"):
        return "OOM"
    if "error" in result:
        return "error"
    return fmt.format(result[key])


def card(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.machine()} {platform.processor()})".replace(" )", ")")


def versions() -> str:
    out = f"torch {torch.__version__}"
    try:
        from importlib.metadata import version

        out += f", flash-linear-attention {version('flash-linear-attention')}"
    except Exception:  # noqa: BLE001 - not installed: the linear mixers run looplm's PyTorch ops
        out += ", no flash-linear-attention (PyTorch ops)"
    if torch.version.cuda:
        out += f", CUDA {torch.version.cuda}"
    return out


def shape_line(args: argparse.Namespace) -> str:
    """The models' shape as one line, and per model its preset, layout and parameter count
    (built on the meta device: no memory)."""
    from looplm import LoopLM

    rows = []
    for name in args.models:
        cfg = model_config(args.shape, name, max_len_for(args.contexts[-1], args.new), args.d_model, args.heads)
        with torch.device("meta"):
            n = sum(p.numel() for p in LoopLM(cfg).parameters())
        rows.append(f"{name} `{SHAPES[args.shape][name][0]}` {cfg.layout}, {n / 1e6:,.1f}M parameters")
    if args.shape == "tiny":
        head = f"LT2 tiny presets widened to d_model {args.d_model}, {args.heads} heads"
    else:
        head = "the paper's looped 0.6B models (lt2.txt Table 2)"
    return f"Shape `{args.shape}`: {head}: " + "; ".join(rows) + "."


def method_line(args: argparse.Namespace) -> str:
    precision = ("bf16 (parameters cast with `model.to(torch.bfloat16)`, no autocast)" if args.dtype == "bf16"
                 else "fp32")
    if args.decode_via == "generate":
        how = (f"decode through greedy `model.generate`{f' with `compile={args.compile!r}`' if args.compile else ''}: "
               f"1 and 1 + {args.new} tokens, decode tokens/s from the difference; warm-up: both calls once, untimed")
    else:
        how = (f"decode through the cache API: {args.new} single-token steps, tokens/s from the median step; "
               f"warm-up: one untimed prefill and {WARMUP_STEPS} decode steps on a fresh cache")
    return f"Precision {precision}; batch {args.batch}; {how}; {args.clock} clock."


def render(args: argparse.Namespace, results: dict, header: list[str]) -> str:
    """The report of the cells measured so far (``…`` marks those not yet run)."""
    longest, shortest = args.contexts[-1], args.contexts[0]
    contexts = " | ".join(f"S={s}" for s in args.contexts)
    rule = " | ".join("---" for _ in args.contexts)
    lines = list(header)
    missing = sum((m, s) not in results for m in args.models for s in args.contexts)
    if missing:
        lines += [f"**Partial**: {missing} of {len(args.models) * len(args.contexts)} cells not measured "
                  "(the run is going on, or was stopped at its deadline).", ""]
    for title, key, fmt in (("Prefill: tokens/s", "prefill_tok_s", "{:,.0f}"),
                            ("Decode: tokens/s", "decode_tok_s", "{:,.1f}"),
                            ("Peak memory of prefill + decode: MiB", "peak_mib", "{:,.0f}")):
        lines += [f"## {title}", "", f"| model | {contexts} |", f"| --- | {rule} |"]
        lines += [f"| {m} | " + " | ".join(cell(results.get((m, s)), key, fmt) for s in args.contexts) + " |"
                  for m in args.models]
        lines.append("")
    base = results.get(("looped transformer", longest), {})
    if "decode_tok_s" in base:
        lines += [f"## Decode throughput against the looped transformer at S={longest}", "",
                  f"| model | ratio | decode at S={longest} / at S={shortest} |", "| --- | --- | --- |"]
        for m in args.models:
            r, first = results.get((m, longest), {}), results.get((m, shortest), {})
            ratio = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if "decode_tok_s" in r else "-"
            flat = f"{r['decode_tok_s'] / first['decode_tok_s']:.2f}" if "decode_tok_s" in r and "decode_tok_s" in first else "-"
            lines.append(f"| {m} | {ratio} | {flat} |")
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
    errors = [f"- {m}, S={s}: {r['error']}" for (m, s), r in results.items() if "error" in r]
    if errors:
        lines += ["## Errors", "", *errors, ""]
    return "\n".join(lines)


def default_out(args: argparse.Namespace) -> Path:
    """benchmarks/results/long-context[-SHAPE][-compiled|-cuda-graph]-DEVICE.md (the tiny shape unnamed)."""
    how = {True: ["compiled"], "cuda-graph": ["cuda-graph"]}.get(args.compile, [])
    parts = ["long-context"] + ([args.shape] if args.shape != "tiny" else []) + how
    return Path("benchmarks/results") / ("-".join(parts + [args.device.split(":")[0]]) + ".md")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny",
                        help="tiny: LT2's tiny presets widened by --d-model/--heads; lt2-0.6b: the paper's 0.6B models")
    parser.add_argument("--models", nargs="*", default=MODELS, choices=MODELS, metavar="NAME")
    parser.add_argument("--contexts", nargs="*", type=int, default=list(DEFAULT_CONTEXTS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=16, help="timed decode steps after the prefill")
    parser.add_argument("--d-model", type=int, default=None, help=f"tiny shape only (default {TINY_WIDTH['d_model']})")
    parser.add_argument("--heads", type=int, default=None, help=f"tiny shape only (default {TINY_WIDTH['heads']})")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="bf16 casts the model's parameters (default bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--compile", nargs="?", const=True, default=False, choices=["cuda-graph"],
                        help="decode through model.generate(..., compile=True), the captured decode step; "
                             "--compile cuda-graph: compile='cuda-graph', the eager step recorded as CUDA graphs")
    parser.add_argument("--decode-via", choices=("cache", "generate"), default=None,
                        help="time decode steps through the cache API or through model.generate "
                             "(default: generate with --compile, else cache)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="--decode-via generate: time each call this many times and keep the fastest")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="wall clock, or this process's CPU time (a shared machine; --threads 1)")
    parser.add_argument("--profile", default=None, choices=MODELS, metavar="NAME",
                        help="also report where this model's decode step spends its time at the longest context")
    parser.add_argument("--note", default=None, help="a paragraph added to the results (e.g. the machine's load)")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/long-context[-SHAPE]"
                                                    "[-compiled|-cuda-graph]-DEVICE.md)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return args
    if args.shape != "tiny" and (args.d_model is not None or args.heads is not None):
        parser.error(f"--d-model / --heads widen the tiny shape only; --shape {args.shape} is the paper's width")
    if args.shape == "tiny":
        args.d_model = args.d_model or TINY_WIDTH["d_model"]
        args.heads = args.heads or TINY_WIDTH["heads"]
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.compile and args.decode_via == "cache":
        parser.error("--compile decodes through model.generate(..., compile=True): drop --decode-via cache")
    args.decode_via = args.decode_via or ("generate" if args.compile else "cache")
    if args.compile and "compile" not in inspect.signature(generate_function()).parameters:
        parser.error("--compile: this looplm's generate() has no compile parameter (no captured decode step yet)")
    if args.profile and args.profile not in args.models:
        parser.error(f"--profile {args.profile!r}: not among --models")
    if args.profile and args.decode_via != "cache":
        parser.error("--profile hooks the cache API's decode steps: use it with --decode-via cache")
    if sorted(args.contexts) != args.contexts or not args.contexts:
        parser.error(f"--contexts {args.contexts}: give one or more lengths in increasing order")
    return args


def generate_function():
    from looplm.generation import generate

    return generate


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    if args.child is not None:
        print(json.dumps(measure(json.loads(args.child))))
        return

    longest = args.contexts[-1]
    command = shlex.join(["python", "benchmarks/long_context.py", *(sys.argv[1:] if argv is None else argv)])
    header = [
        "# Long context: whole looped models, prefill and decode",
        "",
        f"Command: `{command.strip()}`  ",
        f"Card: {card(args.device)}; {versions()}; Python {platform.python_version()}; {args.threads} threads.  ",
        f"{shape_line(args)}  ",
        method_line(args),
        "",
    ]
    if args.note:
        header += [args.note, ""]
    out = Path(args.out) if args.out else default_out(args)
    results: dict = {}
    for m in args.models:
        model = None
        if in_process(args):
            try:
                model = build({"model": m, **job_options(args)}, max_len_for(longest, args.new))
            except Exception as error:  # noqa: BLE001 - e.g. out of memory: the model's cells say so
                traceback.print_exc()
                failed = {"oom": True} if isinstance(error, torch.OutOfMemoryError) else {"error": str(error)}
                results.update({(m, s): failed for s in args.contexts})
                publish(render(args, results, header), out, echo=False)
                continue
        for s in args.contexts:
            results[m, s] = run_job(args, model, model=m, context=s, profile=(m == args.profile and s == longest))
            publish(render(args, results, header), out, echo=False)
            print(f"[long_context] {m}, S={s}: {json.dumps({k: v for k, v in results[m, s].items() if k != 'profile'})}",
                  file=sys.stderr, flush=True)
        del model
        if in_process(args):
            torch.cuda.empty_cache()
    print(render(args, results, header))


if __name__ == "__main__":
    main()
