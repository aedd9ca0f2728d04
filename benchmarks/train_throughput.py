"""Training throughput of looped models against the FLOPs looplm's counter charges them
(issue 15), measured side by side in one run.

Every variant is a real :class:`looplm.train.Trainer` (the built-in corpus, byte
tokenizer) timed through its public step, :meth:`Trainer.train_step` (forward, backward,
clipping, AdamW), with ``train.compile`` off and on. Variants, all of unrolled depth 8:

- ``dense``: 8 blocks; ``base`` and ``mesh``: 2+2R2+2 with that topology (``mesh`` with its
  write-read as one Triton kernel on CUDA; ``mesh-torch`` the same model on PyTorch's
  operators, ``model.topology.kernel: torch``, to show what the kernel saves);
- ``spiral``: SpiralFormer-B's schedule 2+1x{1/8,1/4,1/2,1}+2 (MeSH, aggregate down-scaling,
  router up-scaling, each one Triton kernel on CUDA) against ``spiral-full``, the same loop at
  full resolution (2+1R4+2); ``spiral-torch`` with its down- and up-scaling on PyTorch's
  operators (``model.resolution.kernel: torch``), to show what those kernels save;
- ``sgt``: SGT head looping grown as growth leaves it once frozen (the 3 deepest layers,
  half the heads at depth 3, the entropy meter detached) and ``block-loop`` (those layers'
  whole blocks re-applied 3 times), both against ``dense`` (vanilla);
- ``gdn``: ``dense`` with gated DeltaNet in place of softmax attention.

A variant that fails to build or to train (its kernels on a new device, say) is reported
under **Failed** and the others are timed; the script then exits with status 1.

Timing, one target's group of variants at a time (:data:`GROUPS`: the loop-efficiency
variants, SpiralFormer's, SGT's, GDN's, each with its reference; eager first, then compiled):
after ``--warmup`` steps per variant (the compiled ones compile there), ``--repeats`` rounds
each time ``--steps`` steps of the group's variants in turn (interleaved, so a change in the
machine's load hits all alike); a variant's step time is the median over rounds. The reference
is timed again in each group it serves (dense: loop efficiency, SGT, GDN), so every ratio is
measured side by side, and ``--out`` is rewritten after each group: a run stopped at a
deadline keeps the targets it finished (the report says which groups are missing). FLOPs per
token: ``count_flops(model, seq).training_per_token`` (``default`` convention) of the model as
built and grown. MFU: achieved FLOP/s over the device's peak, the data-sheet peak on a known
GPU (looplm.accounting.hardware), else a measured square GEMM in the run's dtype (said so).

The three targets (PASS/FAIL, per compile setting; and, reported beside them, the compiled
dense model's MFU, issue 25's >= 40 % at d = 2048):

1. loop efficiency: a looped model's FLOP/s (throughput per unrolled FLOP) at least 95 % of
   the dense model's;
2. SpiralFormer: its wall-clock saving against its full-resolution loop at least 80 % of its
   FLOP saving;
3. SGT: its step-time overhead over vanilla at most 2x its FLOP overhead.

    python benchmarks/train_throughput.py --threads 2 --out benchmarks/results/train-throughput-cpu.md
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from looplm.accounting import count_flops, device_peak_flops, mfu
from looplm.config import RunConfig
from looplm.train import Trainer
from publish import publish

LOOP = "2+2R2+2"
#: name -> model overrides; every layout unrolls to 8 blocks
VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {"layout": "8"},
    "base": {"layout": LOOP, "topology": {"kind": "base"}},
    "mesh": {"layout": LOOP, "topology": {"kind": "mesh"}},
    "mesh-torch": {"layout": LOOP, "topology": {"kind": "mesh", "kernel": "torch"}},
    "spiral": {"layout": "2+1x{1/8,1/4,1/2,1}+2", "topology": {"kind": "mesh"},
               "resolution": {"down": "aggregate", "up": "router"}},
    "spiral-torch": {"layout": "2+1x{1/8,1/4,1/2,1}+2", "topology": {"kind": "mesh"},
                     "resolution": {"down": "aggregate", "up": "router", "kernel": "torch"}},
    "spiral-full": {"layout": "2+1R4+2", "topology": {"kind": "mesh"}},
    "block-loop": {"layout": "8", "head_loop": {"kind": "block", "max_depth": 3}},
    "sgt": {"layout": "8", "head_loop": {"kind": "heads", "max_depth": 3}},
    "gdn": {"layout": "8", "mixer": {"kind": "gated_deltanet"}},
}
#: the variants each target compares, in the order they are timed: a group's variants side by
#: side, then the next group (the reference again where it serves several)
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loop", ("dense", "base", "mesh", "mesh-torch")),
    ("spiral", ("spiral-full", "spiral", "spiral-torch")),
    ("sgt", ("dense", "sgt", "block-loop")),
    ("gdn", ("dense", "gdn")),
)
SGT_LAYERS = 3  # the deepest layers grown (deep-to-shallow), as benchmarks/sgt.py
LOOP_EFFICIENCY, SPIRAL_SHARE, SGT_FACTOR, DENSE_MFU = 0.95, 0.80, 2.0, 0.40


@dataclasses.dataclass
class Row:
    """One variant under one compile setting: median seconds per optimiser step over rounds."""

    variant: str
    compiled: bool
    group: str  # the GROUPS entry it was timed in (beside that group's other variants)
    seconds: float
    tokens_per_step: int
    flops_per_token: float
    peak: Optional[float]
    first_step_s: float  # the first warm-up step (compilation included when compiled)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.seconds

    @property
    def flops_per_s(self) -> float:
        """Achieved model FLOP/s: throughput per unrolled FLOP, comparable across variants."""
        return self.flops_per_token * self.tokens_per_s

    @property
    def mfu(self) -> Optional[float]:
        return mfu(self.flops_per_token, self.tokens_per_s, self.peak)


def run_config(name: str, args, out_dir: str, compiled: bool) -> RunConfig:
    heads = args.heads or max(4, args.width // 64)
    model = {"d_model": args.width, "n_heads": heads, "max_seq_len": args.seq, **VARIANTS[name]}
    if name == "sgt":
        model["head_loop"] = {**model["head_loop"], "heads": heads // 2}
    return RunConfig.from_dict({
        "model": model,
        "data": {"source": "pydoc", "tokenizer": "byte", "seq_len": args.seq, "val_batches": 1},
        "train": {"out_dir": out_dir, "max_steps": 10**6, "batch_size": args.batch, "device": args.device,
                  "precision": args.dtype, "compile": compiled, "threads": args.threads, "sample_tokens": 0,
                  "eval_every": 0, "save_every": 0, "seed": 0},
    })


def build(name: str, args, out_dir: str, compiled: bool) -> Trainer:
    """The variant's trainer; SGT / Block Loop get their grown structure before the first
    (compiling) step."""
    trainer = Trainer(run_config(name, args, out_dir, compiled), progress=False)
    if trainer.growth is not None:
        blocks = trainer.model.blocks()
        depth = trainer.cfg.model.head_loop.max_depth
        n_heads = trainer.cfg.model.n_heads
        for layer in range(len(blocks) - SGT_LAYERS, len(blocks)):
            weights = None if name == "block-loop" else [1.0] * (n_heads // 2) + [0.0] * (n_heads - n_heads // 2)
            blocks[layer].head_loop.set(depth, weights)
        trainer.growth.meter.detach()  # growth frozen: no more entropy measurement
        trainer.growth.meter = None
    return trainer


def gemm_peak(device: torch.device, dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of ``repeats`` square n×n matmuls: the peak a CPU reaches here."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_of(args, device: torch.device) -> tuple[float, str]:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.peak_flops:
        return args.peak_flops, "given (--peak-flops)"
    known = device_peak_flops(device, dtype)
    if known:
        return known, f"data sheet ({torch.cuda.get_device_name(device)}, {args.dtype})"
    return gemm_peak(device, dtype), f"measured: best 1024x1024 {args.dtype} matmul on this machine"


def groups_of(variants) -> list[tuple[str, list[str]]]:
    """The :data:`GROUPS` to time for ``variants``, each cut to those variants, in order; a
    group left with nothing an earlier group did not time (the reference alone) is dropped."""
    timed, out = set(), []
    for name, members in GROUPS:
        chosen = [v for v in members if v in variants]
        if set(chosen) - timed:
            out.append((name, chosen))
            timed.update(chosen)
    return out


def warmed(name: str, compiled: bool, args, out_dir: str) -> tuple[Trainer, float]:
    """The variant's trainer after ``--warmup`` steps (compiling, when compiled), and the
    seconds of its first step."""
    trainer = build(name, args, out_dir, compiled)
    start = time.perf_counter()
    trainer.train_step()
    first = time.perf_counter() - start
    for _ in range(args.warmup - 1):
        trainer.train_step()
    return trainer, first


def time_rounds(trainers: dict[tuple[str, bool], Trainer], args) -> dict[tuple[str, bool], float]:
    """Median seconds per step of each trainer over ``--repeats`` rounds of ``--steps`` steps,
    the trainers in turn within a round (a change in the machine's load hits all alike)."""
    times: dict[tuple[str, bool], list[float]] = {key: [] for key in trainers}
    for _ in range(args.repeats):
        for key, trainer in trainers.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step()  # reads the loss back: synchronises the device
            times[key].append((time.perf_counter() - start) / args.steps)
    return {key: statistics.median(t) for key, t in times.items()}


def measure(args, on_group: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Build, warm up and time every variant, group by group (:data:`GROUPS`); returns rows,
    ratios, profiles and the peak used. ``on_group`` gets the result so far after each group."""
    settings = [False, True] if args.compile else [False]
    if args.compile:  # one code object per LoopLM method serves every variant: allow their guards
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 4096
    groups = groups_of(args.variants)
    result: dict[str, Any] = {"rows": [], "ratios": [], "peak": None, "peak_source": None, "device": None,
                              "profiles": {}, "failed": {}, "groups": [],
                              "planned": [(group, compiled) for compiled in settings for group, _ in groups]}
    trainers: dict[tuple[str, bool], Trainer] = {}
    first: dict[tuple[str, bool], float] = {}
    with tempfile.TemporaryDirectory() as tmp:

        def ready(name: str, compiled: bool) -> bool:  # built and warmed once, shared by its groups
            key = (name, compiled)
            if key not in trainers and key not in result["failed"]:
                try:  # a variant whose kernels fail on this device is reported; the others are timed
                    trainers[key], first[key] = warmed(name, compiled, args, str(Path(tmp) / f"{name}-{int(compiled)}"))
                except Exception as err:  # noqa: BLE001 - any failure of one variant
                    result["failed"][key] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
                    print(f"[train_throughput] {name} (compile={compiled}) failed: {result['failed'][key]}",
                          file=sys.stderr, flush=True)
            return key in trainers

        for compiled in settings:
            for group, members in groups:
                jobs = {(name, compiled): trainers[(name, compiled)] for name in members if ready(name, compiled)}
                if jobs and result["device"] is None:
                    result["device"] = next(iter(jobs.values())).device
                    result["peak"], result["peak_source"] = peak_of(args, result["device"])
                seconds = time_rounds(jobs, args)
                result["rows"] += [Row(name, c, group, seconds[(name, c)], args.batch * args.seq,
                                       count_flops(trainer.model, args.seq).training_per_token, result["peak"],
                                       first[(name, c)]) for (name, c), trainer in jobs.items()]
                for key, trainer in jobs.items():
                    if key[0] in args.profile and key not in result["profiles"]:
                        result["profiles"][key] = profile(trainer, args.steps)
                result["ratios"] = ratios(result["rows"])
                result["groups"].append((group, compiled))
                print(f"[train_throughput] {group} group ({'compiled' if compiled else 'eager'}) timed: "
                      + ", ".join(f"{name} {1e3 * t:.1f} ms" for (name, _), t in seconds.items()),
                      file=sys.stderr, flush=True)
                if on_group is not None:
                    on_group(result)
    if not result["rows"]:
        raise RuntimeError(f"every variant failed: {result['failed']}")
    return result


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """The issue's three ratios for each compile setting and group whose variants were
    measured (each from rows timed side by side)."""
    out = []
    for compiled in sorted({r.compiled for r in rows}):
        mode = "compiled" if compiled else "eager"
        for group in dict.fromkeys(r.group for r in rows if r.compiled == compiled):
            by = {r.variant: r for r in rows if r.compiled == compiled and r.group == group}
            get = by.get
            dense = get("dense")
            for loop in ("base", "mesh"):
                if dense and get(loop):
                    value = get(loop).flops_per_s / dense.flops_per_s
                    out.append(dict(target="loop efficiency", what=f"{loop} FLOP/s / dense FLOP/s", mode=mode,
                                    value=value, bound=f">= {LOOP_EFFICIENCY:.2f}", passed=value >= LOOP_EFFICIENCY))
            spiral, full = get("spiral"), get("spiral-full")
            if spiral and full:
                flop_saving = 1 - spiral.flops_per_token / full.flops_per_token
                wall_saving = 1 - spiral.seconds / full.seconds
                value = wall_saving / flop_saving
                out.append(dict(target="SpiralFormer saving", mode=mode, value=value, bound=f">= {SPIRAL_SHARE:.2f}",
                                what=f"wall-clock saving {wall_saving:+.1%} / FLOP saving {flop_saving:+.1%}",
                                passed=value >= SPIRAL_SHARE))
            for name in ("sgt", "block-loop"):
                if dense and get(name):
                    flop_overhead = get(name).flops_per_token / dense.flops_per_token - 1
                    time_overhead = get(name).seconds / dense.seconds - 1
                    value = time_overhead / flop_overhead
                    target = name == "sgt"
                    out.append(dict(target="SGT overhead" if target else "(Block Loop overhead, no target)",
                                    mode=mode, value=value, bound=f"<= {SGT_FACTOR:.1f}" if target else "-",
                                    what=f"step-time overhead {time_overhead:+.1%} / FLOP overhead "
                                         f"{flop_overhead:+.1%}",
                                    passed=value <= SGT_FACTOR if target else None))
    return out


#: profiler categories by operator name (self time): what scales with FLOPs and what does not
CATEGORIES = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
              ("attention", ("scaled_dot_product",)), ("compiled kernels", ("CompiledFxGraph",)))


def profile(trainer: Trainer, steps: int) -> dict[str, float]:
    """Self time per step (ms) by category over ``steps`` steps (torch.profiler), the rest as
    ``other ops`` (elementwise, copies, indexing, the optimiser), and operator calls per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = trainer.device.type == "cuda"
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            trainer.train_step()
    out = {name: 0.0 for name, _ in CATEGORIES} | {"other ops": 0.0, "calls": 0.0}
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us <= 0:
            continue
        category = next((name for name, keys in CATEGORIES if any(k in event.key for k in keys)), "other ops")
        out[category] += us / 1e3 / steps
        out["calls"] += event.count / steps
    return out


def gdn_backend(device: torch.device) -> str:
    """Which kernels GDN's training step ran on (looplm.ops.backend.use_fla)."""
    from looplm.ops import fla_hopper
    from looplm.ops.backend import fla_guard_allows, fla_installed

    if device.type != "cuda" or not fla_installed():
        return "looplm's PyTorch chunk op (no CUDA device or no flash-linear-attention)"
    if fla_guard_allows(device):
        return "fla's kernels"
    checked = [ok for (op, _, _), ok in fla_hopper.verdicts().items() if op.family == "delta" and not op.channels]
    if checked and all(checked):
        return ("fla's kernels, its dq/dk kernel at 128-wide tiles, checked against the PyTorch op on this device "
                "(fla refuses its gated backward on this GPU and Triton; looplm.ops.fla_hopper)")
    return "looplm's PyTorch chunk op (fla's gated backward failed its check on this GPU and Triton)"


def report(args, result: dict[str, Any], argv: list[str], load: tuple[float, float]) -> str:
    rows = result["rows"]
    peak = "-" if result["peak"] is None else f"{result['peak']:.3e} FLOP/s ({result['peak_source']})"
    lines = [
        "# Training throughput: looped models per unrolled FLOP",
        "",
        f"Command: `python benchmarks/train_throughput.py {' '.join(argv)}`  ",
        f"Machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads; load average {load[0]:.2f} at start, {load[1]:.2f} at end; "
        f"device {result['device']}; torch {torch.__version__}, Python {platform.python_version()}.  ",
        f"Model: d={args.width}, unrolled depth 8, vocab 257 (bytes); batch {args.batch} x {args.seq} tokens, "
        f"{args.dtype}; median over {args.repeats} interleaved rounds of {args.steps} step(s) after "
        f"{args.warmup} warm-up step(s), one group of variants at a time (each against its reference, timed "
        f"in the same rounds).  ",
        f"Peak for MFU: {peak}.",
    ]
    missing = [(group, compiled) for group, compiled in result["planned"] if (group, compiled) not in result["groups"]]
    if missing:
        lines += ["", "**Not timed** (the run stopped before these groups): " + ", ".join(
            f"{group} ({'compiled' if compiled else 'eager'})" for group, compiled in missing) + "."]
    lines += [
        "",
        "| group | variant | compile | step (ms) | tokens/s | model FLOPs/token | achieved GFLOP/s | vs dense | MFU "
        "| first step (s) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def timed(name: str, compiled: bool, group: str) -> Optional[Row]:  # timed in ``group``, else in any
        same = [r for r in rows if r.variant == name and r.compiled == compiled]
        return next((r for r in same if r.group == group), same[0] if same else None)

    for r in rows:
        dense = timed("dense", r.compiled, r.group)
        vs = r.flops_per_s / dense.flops_per_s if dense else float("nan")
        lines.append(f"| {r.group} | {r.variant} | {'yes' if r.compiled else 'no'} | {1e3 * r.seconds:.1f} "
                     f"| {r.tokens_per_s:,.0f} | {r.flops_per_token:.4e} | {r.flops_per_s / 1e9:.2f} | {vs:.2f} | "
                     f"{'-' if r.mfu is None else f'{100 * r.mfu:.1f} %'} | {r.first_step_s:.1f} |")
    gdn = [(r, timed("dense", r.compiled, r.group)) for r in rows if r.variant == "gdn"]
    if any(dense for _, dense in gdn):
        lines += ["", "GDN vs attention (tokens/s ratio, no target): " + ", ".join(
            f"{'compiled' if r.compiled else 'eager'} {r.tokens_per_s / dense.tokens_per_s:.2f}"
            for r, dense in gdn if dense)]
    if gdn:
        lines += ["", f"GDN trains on: {gdn_backend(torch.device(result['device']))}."]
    first_compiled: dict[str, Row] = {}  # each variant once (dense is timed in several groups)
    for r in rows:
        if r.compiled:
            first_compiled.setdefault(r.variant, r)
    speedups = [(r, timed(r.variant, False, r.group)) for r in first_compiled.values()]
    if any(eager for _, eager in speedups):
        lines += ["", "Compile speed-up (eager step / compiled step): " + ", ".join(
            f"{r.variant} {eager.seconds / r.seconds:.2f}" for r, eager in speedups if eager)]
    compiled_dense = [r for r in rows if r.variant == "dense" and r.compiled and r.mfu is not None]
    if compiled_dense:
        lines += ["", f"Compiled dense MFU at d = {args.width}: {100 * compiled_dense[0].mfu:.1f} % (issue 25's "
                  f"target: >= {100 * DENSE_MFU:.0f} % at d = 2048)."]
    if result["failed"]:
        lines += ["", "**Failed** (not timed): " + "; ".join(
            f"{name}{' compiled' if compiled else ''}: `{error}`" for (name, compiled), error in result["failed"].items())]
    lines += ["", "## Targets", "", "| target | compile | measured | value | bound | result |",
              "| --- | --- | --- | ---: | --- | --- |"]
    for q in result["ratios"]:
        verdict = "-" if q["passed"] is None else ("PASS" if q["passed"] else "FAIL")
        lines.append(f"| {q['target']} | {q['mode']} | {q['what']} | {q['value']:.2f} | {q['bound']} | {verdict} |")
    if result["profiles"]:
        categories = [name for name, _ in CATEGORIES] + ["other ops"]
        lines += ["", "## Profile", "", "torch.profiler, self time per step (ms) by operator category; the profiler's "
                  "own cost inflates small operators.", "",
                  "| variant | compile | " + " | ".join(categories) + " | total | operator calls/step |",
                  "| --- | --- | " + " | ".join("---:" for _ in categories) + " | ---: | ---: |"]
        for (name, compiled), cat in result["profiles"].items():
            cells = " | ".join(f"{cat[c]:.1f}" for c in categories)
            lines.append(f"| {name} | {'yes' if compiled else 'no'} | {cells} | {sum(cat[c] for c in categories):.1f} "
                         f"| {cat['calls']:.0f} |")
    return "\n".join(lines) + "\n"


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="train.precision")
    p.add_argument("--width", type=int, default=64, help="d_model")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default max(4, width / 64))")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the median is reported")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (compilation happens here)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure every variant under train.compile=true (default on)")
    p.add_argument("--threads", type=int, default=None, help="train.threads (CPU intra-op threads)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s for MFU (default: see above)")
    p.add_argument("--profile", nargs="*", default=[], choices=list(VARIANTS),
                   help="append a torch.profiler breakdown of these variants' steps (each compile setting)")
    p.add_argument("--out", default=None, help="write the markdown report here (printed either way)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    load_start = os.getloadavg()[0]

    text = ""

    def write(result: dict[str, Any]) -> None:  # after each group: a run cut at a deadline keeps what it timed
        nonlocal text
        text = report(args, result, argv, (load_start, os.getloadavg()[0]))
        publish(text, args.out, echo=False)

    result = measure(args, on_group=write)  # the last group's report is the whole run's
    print(text)
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)  # the report is written either way
