"""Token mixers side by side: training cost and decode cost against softmax attention.

For every mixer kind (or those given with --kinds), in one run:

* forward + backward time and peak memory of one mixer layer at sequence lengths
  512 ... 8192 (B 1, d_model = heads · head_dim), each measured in a fresh subprocess so
  its peak resident memory (ru_maxrss above the process's baseline) is its own. The
  memory is taken in a second subprocess with glibc's mmap threshold fixed at 128 KiB
  (``MALLOC_MMAP_THRESHOLD_``): glibc's default raises that threshold as large blocks are
  freed, after which freed memory stays resident and the peak counts it again and again
  (a loop over blocks of queries then looks like it keeps every block);
* decode time per token against a cache filled to context lengths 512 ... 8192 (it stays
  flat for the linear mixers, grows with context for attention);
* Gated DeltaNet's chunkwise op against flash-linear-attention's CPU reference
  ``naive_chunk_gated_delta_rule`` (issue 7's speed target: ours >= 1.5x faster).

Writes a markdown table (``--out``, default benchmarks/results/mixers-<device>.md) with
the exact command line and machine at the top. On a GPU with flash-linear-attention
installed, the layers run fla's kernels (``--device cuda``); ``--compare-backends`` then
also times the PyTorch path of every mixer that has an fla kernel (rows marked
``[torch]``). On CUDA, jobs run in-process (peak memory is torch's allocator peak).

    python benchmarks/mixers.py --threads 2
    python benchmarks/mixers.py --device cuda --dtype bfloat16 --compare-backends --batch 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
#: Options a kind needs at this width (DSA's indexer must cover the rotary head dims).
BENCH_OPTIONS = {"sliding_window": {"window": 512}, "dsa": {"index_head_dim": 64, "top_k": 512}}


#: mixers with a flash-linear-attention kernel (looplm.ops.backend.use_fla)
FLA_KINDS = ("linear_attention", "retnet", "gla", "hgrn2", "mamba2", "deltanet", "gated_deltanet", "kda")
#: those whose op has a decay gate (fla's gated kernels)
GATED_KINDS = ("retnet", "gla", "hgrn2", "mamba2", "gated_deltanet", "kda")


@contextlib.contextmanager
def _backend(name: str):
    """``torch``: the PyTorch path even where fla's kernels would run; ``auto``: the default."""
    import looplm.ops.backend as backend

    original = backend.fla_installed
    if name == "torch":
        backend.fla_installed = lambda: False
    try:
        yield
    finally:
        backend.fla_installed = original


def _layer(kind: str, heads: int, head_dim: int, device: str):
    from looplm.mixers import MixerConfig
    from looplm.model_config import ModelConfig

    spec = MixerConfig.from_dict({"kind": kind, **BENCH_OPTIONS.get(kind, {})})
    model_cfg = ModelConfig(d_model=heads * head_dim, n_heads=heads, layout="1", max_seq_len=1 << 20, bias=False)
    return spec.build(model_cfg.block_shape).to(device), model_cfg


def _context(model_cfg, batch: int, length: int, past: int, device: str):
    from looplm.mixers import MixerContext
    from looplm.modules.rotary import Rotary

    positions = torch.arange(past, past + length, device=device).expand(batch, length)
    rope = Rotary(model_cfg.rotary_dim, model_cfg.rope_theta).to(device)(positions, torch.float32)
    valid = torch.ones(batch, past + length, dtype=torch.bool, device=device)
    return MixerContext(rope=rope, valid=valid, past=past, padded=False)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, device: str, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_train(kind: str, length: int, heads: int, head_dim: int, device: str, repeats: int,
                  batch: int = 1, dtype: str = "float32") -> dict:
    """Forward + backward seconds of one layer at one length (median of ``repeats``), with
    the allocator's peak MiB on CUDA; ``repeats=0``: one step and its peak resident MiB only
    (the CPU memory run, see :func:`_train`)."""
    torch.manual_seed(0)
    layer, cfg = _layer(kind, heads, head_dim, device)
    layer = layer.to(getattr(torch, dtype))
    ctx = _context(cfg, batch, length, 0, device)
    x = torch.randn(batch, length, cfg.d_model, device=device, dtype=getattr(torch, dtype), requires_grad=True)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()

    def step():
        out, _ = layer(x, ctx, None)
        out.sum().backward()

    if repeats == 0:  # memory only: one step
        step()
        return {"peak_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024}  # KiB on Linux
    seconds = _time(step, device, repeats)
    if device.startswith("cuda"):
        return {"seconds": seconds, "peak_mib": torch.cuda.max_memory_allocated() / 2**20}
    return {"seconds": seconds}


@torch.no_grad()
def measure_decode(kind: str, context: int, heads: int, head_dim: int, device: str, repeats: int,
                   batch: int = 1, dtype: str = "float32") -> dict:
    """Seconds per decoded token with a cache holding ``context`` positions."""
    torch.manual_seed(0)
    layer, cfg = _layer(kind, heads, head_dim, device)
    layer = layer.to(getattr(torch, dtype))
    x = torch.randn(batch, context, cfg.d_model, device=device, dtype=getattr(torch, dtype))
    _, state = layer(x, _context(cfg, batch, context, 0, device), None)
    token = torch.randn(batch, 1, cfg.d_model, device=device, dtype=getattr(torch, dtype))
    ctx = _context(cfg, batch, 1, context, device)
    return {"seconds": _time(lambda: layer(token, ctx, state), device, repeats)}


def measure_gdn_reference(length: int, heads: int, head_dim: int, repeats: int) -> dict:
    """Our chunkwise GDN op vs fla's naive_chunk_gated_delta_rule, forward + backward."""
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule

    from looplm.ops.delta.chunk import chunk_delta_rule

    torch.manual_seed(0)
    shape = (1, length, heads, head_dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    k_n = torch.nn.functional.normalize(k.detach(), dim=-1).requires_grad_(True)
    beta = torch.rand(1, length, heads).requires_grad_(True)
    g = torch.nn.functional.logsigmoid(torch.randn(1, length, heads)).requires_grad_(True)

    def ours():
        o, _ = chunk_delta_rule(q, k_n, v, beta, g)
        o.sum().backward()

    def theirs():
        o, _ = naive_chunk_gated_delta_rule(q, k_n, v, g, beta)
        o.sum().backward()

    return {"ours": _time(ours, "cpu", repeats), "fla_naive_chunk": _time(theirs, "cpu", repeats)}


def _measure(job: dict) -> dict:
    fn = {"train": measure_train, "decode": measure_decode}[job.pop("what")]
    try:
        with _backend(job.pop("backend", "auto")):
            return fn(**job)
    except Exception as err:  # report, keep the table going
        return {"error": f"{type(err).__name__}: {err}"[:200]}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    sys.stdout.write(json.dumps(_measure(json.loads(args.child))) + "\n")


#: the environment of the memory-measuring subprocess (see the module docstring)
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def _train(args: argparse.Namespace, **job) -> dict:
    """Time of a training step and its peak memory (on CPU from a second, memory-only run)."""
    result = _run_child(args, what="train", **job)
    if not args.device.startswith("cuda") and "error" not in result:
        result.update(_run_child(args, what="train", env=FIXED_MMAP_THRESHOLD, **{**job, "repeats": 0}))
    return result


def _run_child(args: argparse.Namespace, env: Optional[dict] = None, **job) -> dict:
    if args.device.startswith("cuda"):  # the allocator's peak is per job; no fresh process needed
        return _measure(job)
    cmd = [sys.executable, __file__, "--threads", str(args.threads), "--child", json.dumps(job)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1][:200] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row_name(row: tuple[str, str]) -> str:
    return f"{row[0]} [torch]" if row[1] == "torch" else row[0]


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else device


def _backend_notes(device: str) -> list[str]:
    """What the unmarked rows ran on: fla's kernels or PyTorch, and where the gated kinds
    had to train on PyTorch (looplm.ops.backend.use_fla)."""
    from looplm.ops import fla_hopper
    from looplm.ops.backend import fla_gated_backward_ok, fla_installed

    if not (device.startswith("cuda") and fla_installed()):
        return ["", "Backend: looplm's PyTorch ops for every row (no CUDA device or no flash-linear-attention)."]
    import fla
    import triton

    notes = ["", f"Backend: flash-linear-attention {fla.__version__} (Triton {triton.__version__}) kernels for "
             f"{', '.join(FLA_KINDS)}; PyTorch for the rest and for rows marked [torch]."]
    if not fla_gated_backward_ok(torch.device(device)):
        verdicts = fla_hopper.verdicts()
        passed = sorted({f"{op.family} ({'per channel' if op.channels else 'scalar'})" for (op, _, _), ok in
                         verdicts.items() if ok})
        failed = sorted({f"{op.family} ({'per channel' if op.channels else 'scalar'})" for (op, _, _), ok in
                         verdicts.items() if not ok})
        notes.append(f"fla refuses the gated backward on this GPU and Triton (fla #640); looplm checked fla's "
                     f"kernels (the scalar-gated dq/dk kernel at 128-wide tiles) against PyTorch on the device: "
                     f"passed {', '.join(passed) or 'none'}; failed (those forward + backward rows ran on PyTorch) "
                     f"{', '.join(failed) or 'none'}.")
    return notes


def _cell(result: dict, key: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    if "error" in result:
        return "error"
    return fmt.format(result[key] * scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="*", default=None, help="mixer kinds (default: all registered)")
    parser.add_argument("--lengths", nargs="*", type=int, default=list(DEFAULT_LENGTHS))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--compare-backends", action="store_true",
                        help="also time the PyTorch path of mixers that have fla kernels (rows '[torch]')")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    from looplm.mixers.registry import MIXER_CONFIGS

    kinds = args.kinds or list(MIXER_CONFIGS)
    common = dict(heads=args.heads, head_dim=args.head_dim, device=args.device, repeats=args.repeats,
                  batch=args.batch, dtype=args.dtype)
    rows = [(k, "auto") for k in kinds]
    if args.compare_backends:
        rows += [(k, "torch") for k in kinds if k in FLA_KINDS]
    lines = [
        "# Token mixers: training and decoding cost",
        "",
        f"Command: `python benchmarks/mixers.py {' '.join(sys.argv[1:])}`  ",
        f"Machine: {platform.machine()}, {platform.processor() or 'unknown CPU'}, torch {torch.__version__}, "
        f"{args.threads} threads, device {_device_name(args.device)}, {args.dtype}; B={args.batch}, "
        f"{args.heads} heads x {args.head_dim} dims "
        f"(d_model {args.heads * args.head_dim}); median of {args.repeats} runs.",
        *_backend_notes(args.device),
        "",
        "## Forward + backward, one layer: milliseconds (peak MiB)",
        "",
        "| mixer | " + " | ".join(f"T={n}" for n in args.lengths) + " | vs attention at T=" + str(args.lengths[-1]) + " |",
        "| --- | " + " | ".join("---" for _ in args.lengths) + " | --- |",
    ]
    train = {row: [_train(args, kind=row[0], backend=row[1], length=n, **common)
                   for n in args.lengths] for row in rows}
    ref = train.get(("attention", "auto"), [{}])[-1]
    for row in rows:
        cells = [f"{_cell(r, 'seconds', 1e3)} ({_cell(r, 'peak_mib', fmt='{:.0f}')})" for r in train[row]]
        last = train[row][-1]
        ratio = f"{last['seconds'] / ref['seconds']:.2f}x" if "seconds" in last and "seconds" in ref else "-"
        lines.append(f"| {_row_name(row)} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "## Decode: milliseconds per token at context length", "",
              "| mixer | " + " | ".join(f"S={n}" for n in args.lengths) + " |",
              "| --- | " + " | ".join("---" for _ in args.lengths) + " |"]
    for row in rows:
        cells = [_cell(_run_child(args, what="decode", kind=row[0], backend=row[1], context=n, **common),
                       "seconds", 1e3, "{:.2f}") for n in args.lengths]
        lines.append(f"| {_row_name(row)} | " + " | ".join(cells) + " |")
    if args.device == "cpu":
        try:
            torch.set_num_threads(args.threads)
            lines += ["", "## Gated DeltaNet op vs flash-linear-attention's CPU reference (forward + backward, ms)", "",
                      "| T | looplm chunk | fla naive_chunk_gated_delta_rule | speed-up |", "| --- | --- | --- | --- |"]
            for n in args.lengths:
                r = measure_gdn_reference(n, args.heads, args.head_dim, args.repeats)
                lines.append(f"| {n} | {r['ours'] * 1e3:.1f} | {r['fla_naive_chunk'] * 1e3:.1f} | "
                             f"{r['fla_naive_chunk'] / r['ours']:.2f}x |")
        except ImportError as err:
            lines += ["", f"(GDN reference comparison skipped: {err})"]
    out = Path(args.out or Path(__file__).parent / "results" / f"mixers-{args.device.split(':')[0]}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + f"\n\nwritten to {out}\n")


if __name__ == "__main__":
    main()
