"""What a step launches, counted on CPU (DESIGN.md invariant 6): the targets of issues 25
and 30 in one table each, measured side by side in one run.

* decoding: dispatched operators per decoded token per block pass and host syncs per
  token, through the public ``generate`` (17 minus 1 new tokens, greedy, batch 2), for the
  LT2 tiny presets the long-context benchmark compares;
* training: dispatched operators and host syncs of one forward + backward at d = 64 through
  the public model, for ``benchmarks/train_throughput.py``'s variants (SGT grown as that
  benchmark grows it), with each issue-25 ratio against its target; counted twice, with
  PyTorch's operators everywhere and on the CUDA path (looplm's Triton kernels, each one
  custom operator, run on CPU under ``TRITON_INTERPRET=1`` in a child process).

Views, allocations and metadata-only operators are not counted
(``looplm.accounting.dispatch``). The counts are the eager path's: a GPU runs the same
operators as kernels, except where a fused CUDA kernel replaces several; the "kernels"
column counts torch's own such fusion (``F.rms_norm``: one kernel for six CPU
operators), issue 30's targets are met on it. The tests keep each count from growing back.

With ``--device cuda`` the same decoding and training steps run on the GPU (bf16
parameters by default, flash-linear-attention where installed, one untimed warm-up) and
``torch.profiler`` counts what the device really ran: GPU kernels and copies, and the
host's launch calls (``cudaLaunchKernel`` and kin, one ``cudaGraphLaunch`` per replayed
graph), per decoded token per block pass — ``--compile`` also decodes through the
captured step.

    python benchmarks/launches.py [--out benchmarks/results/launches-cpu.md]
    python benchmarks/launches.py --device cuda [--compile [cuda-graph]] --out benchmarks/results/launches-cuda.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_throughput as throughput  # noqa: E402

from looplm import LoopLM, load_config  # noqa: E402
from looplm.accounting.dispatch import count_dispatch  # noqa: E402
from looplm.ops.backend import triton_installed  # noqa: E402
from looplm.resolution import MultiResolution  # noqa: E402
from looplm.topology import MeshTopology  # noqa: E402
from publish import publish  # noqa: E402

#: decoding: model -> (preset, issue 30's target in operators per decoded token per block pass)
DECODE = {
    "looped transformer": ("tiny-lt2-transformer", 24),
    "looped GDN": ("tiny-lt2-gdn", 30),
    "Full+GDN hybrid": ("tiny-lt2-hybrid-full-gdn", 30),
    "GDN+DSA hybrid": ("tiny-lt2-hybrid-gdn-dsa", 45),
}
#: training: (variant, reference variant, issue 25's target for ops(variant) / ops(reference))
TRAIN_RATIOS = [("mesh", "base", 1.05), ("spiral", "spiral-full", 1.00), ("sgt", "dense", 1.40)]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def decode_model(preset: str, device: str = "cpu", dtype: str = "fp32"):
    torch.manual_seed(0)
    model = LoopLM(load_config(preset).model).to(device, DTYPES[dtype]).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    return model, ids


def decode_counts(preset: str) -> tuple[float, float, float]:
    """(operators, host syncs, CUDA-fused kernels) per decoded token, the operators and
    kernels per block pass: generate(17) minus generate(1), over 16 tokens."""
    model, ids = decode_model(preset)
    one, _ = count_dispatch(lambda: model.generate(ids, max_new_tokens=1, temperature=0))
    many, _ = count_dispatch(lambda: model.generate(ids, max_new_tokens=17, temperature=0))
    passes = model.cfg.block_passes
    return (many.ops - one.ops) / 16 / passes, (many.syncs - one.syncs) / 16, (many.kernels - one.kernels) / 16 / passes


#: the host's calls that launch work on the device (one per kernel; one per CUDA graph)
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                          "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync"})


def profiled(fn) -> tuple[int, int]:
    """(GPU kernels and copies the device ran, host launch calls) of one ``fn()``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    device = sum(1 for e in events if e.device_type == DeviceType.CUDA)
    launches = sum(1 for e in events if e.name in LAUNCH_CALLS)
    return device, launches


def cuda_decode_counts(preset: str, dtype: str, compile) -> tuple[float, float]:
    """(device kernels, launch calls) per decoded token per block pass on the GPU (``compile``:
    False, True or "cuda-graph", as ``generate`` takes it)."""
    model, ids = decode_model(preset, "cuda", dtype)
    options = {"compile": compile} if compile else {}
    for n in (1, 17):  # warm-up: Triton autotuning, compilation, CUDA graph capture
        model.generate(ids, max_new_tokens=n, temperature=0, **options)
    one = profiled(lambda: model.generate(ids, max_new_tokens=1, temperature=0, **options))
    many = profiled(lambda: model.generate(ids, max_new_tokens=17, temperature=0, **options))
    passes = model.cfg.block_passes
    return tuple((m - o) / 16 / passes for m, o in zip(many, one))


def train_counts(variant: str, directory: str, kernel: str = "torch"):
    """Operators of one forward + backward of ``variant`` at d = 64 (gradients already
    allocated, as in training); ``kernel``: where MeSH's write-reads and SpiralFormer's
    down- and up-scaling run (``triton``: as on CUDA, one custom operator per kernel
    launch)."""
    args = throughput.parse(["--width", "64", "--seq", "32", "--batch", "2", "--no-compile"])
    model = throughput.build(variant, args, str(Path(directory) / variant), False).model
    for module in model.modules():
        if isinstance(module, (MeshTopology, MultiResolution)):
            module.kernel = kernel
    ids = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(0))

    def step():
        model(ids[:, :-1], ids[:, 1:]).loss.backward()

    step()  # gradients exist from here on, as in training
    model.zero_grad(set_to_none=True)
    counts, _ = count_dispatch(step)
    return counts


TRAIN_VARIANTS = ("dense", "base", "mesh", "spiral-full", "spiral", "sgt")


def all_train_counts() -> dict[str, tuple[int, int, Optional[int]]]:
    """variant -> (operators, host syncs, operators on the CUDA path): the last with looplm's
    Triton kernels (None without triton). Run where the interpreter is on (the caller's
    child process), since Triton picks it before compiling anything."""
    fused = triton_installed() and os.environ.get("TRITON_INTERPRET") == "1"
    with tempfile.TemporaryDirectory() as tmp:
        counts = {}
        for v in TRAIN_VARIANTS:
            plain = train_counts(v, tmp)
            cuda = train_counts(v, tmp, "triton").ops if fused else None
            counts[v] = (plain.ops, plain.syncs, cuda)
    return counts


def report() -> str:
    lines = ["# Launch counts (CPU, eager)", "", "Written by `python benchmarks/launches.py`; torch "
             f"{torch.__version__}. Dispatched operators (views, allocations and metadata excluded) and "
             "host syncs, `looplm.accounting.dispatch`; kernels: the operators with each `F.rms_norm` "
             "counted as the one fused CUDA kernel it is (`DispatchCount.kernels`).", "",
             "## Decoding (issue 30): per decoded token per block pass, through `generate`", "",
             "| model | preset | operators | kernels | target | host syncs per token |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, (preset, target) in DECODE.items():
        ops, syncs, kernels = decode_counts(preset)
        lines.append(f"| {name} | `{preset}` | {ops:.1f} | {kernels:.1f} | ≤ {target} | {syncs:g} |")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, __file__, "--train-counts"], env=env, capture_output=True, text=True,
                           check=True)
    counts = json.loads(child.stdout.strip().splitlines()[-1])
    cuda = all(c[2] is not None for c in counts.values())
    lines += ["", "## Training (issue 25): one forward + backward at d = 64", "",
              "Operators: PyTorch's everywhere. CUDA path: as a GPU runs the step, looplm's Triton kernels "
              "(MeSH's write-read: `looplm.ops.write_read_triton`; SpiralFormer's self-aggregation and router: "
              "`looplm.ops.resolution_triton`) one custom operator per launch, counted "
              "on CPU under `TRITON_INTERPRET=1`" + ("" if cuda else " (not counted: triton is not installed)")
              + "; the targets are on it.", "",
              "| variant | operators | CUDA path | host syncs |", "| --- | --- | --- | --- |"]
    for variant, (ops, syncs, fused) in counts.items():
        lines.append(f"| {variant} | {ops} | {'—' if fused is None else fused} | {syncs} |")
    lines += ["", "| ratio | operators | CUDA path | target |", "| --- | --- | --- | --- |"]
    for variant, reference, target in TRAIN_RATIOS:
        plain = counts[variant][0] / counts[reference][0]
        fused = f"{counts[variant][2] / counts[reference][2]:.3f}" if cuda else "—"
        lines.append(f"| {variant} / {reference} | {plain:.3f} | {fused} | ≤ {target:.2f} |")
    return "\n".join(lines) + "\n"


def cuda_report(dtype: str, compile) -> str:
    name = torch.cuda.get_device_name()
    flag = {False: "", True: " --compile", "cuda-graph": " --compile cuda-graph"}[compile]
    how = {False: "eager", True: "compiled decode step", "cuda-graph": "eager step recorded as CUDA graphs"}[compile]
    command = f"python benchmarks/launches.py --device cuda --dtype {dtype}{flag}"
    lines = [f"# Launch counts ({name}, {dtype}, {how})", "",
             f"Written by `{command}`; torch {torch.__version__}. `torch.profiler` over generate(17) minus "
             "generate(1) after one untimed warm-up of each: kernels and copies the GPU ran, and the "
             "host's launch calls, per decoded token per block pass.", "",
             "| model | preset | GPU kernels | launch calls | target (issue 30, CPU-counted) |",
             "| --- | --- | --- | --- | --- |"]
    for label, (preset, target) in DECODE.items():
        kernels, launches = cuda_decode_counts(preset, dtype, compile)
        lines.append(f"| {label} | `{preset}` | {kernels:.1f} | {launches:.1f} | ≤ {target} |")
        print(f"[launches] {lines[-1]}", file=sys.stderr, flush=True)  # a run cut at its deadline keeps its rows
    return "\n".join(lines) + "\n"


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="also write the tables to this markdown file")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cpu: dispatched operators (default); cuda: profiled GPU kernels and launches")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="parameters' dtype on CUDA")
    parser.add_argument("--compile", nargs="?", const=True, default=False, choices=["cuda-graph"],
                        help="on CUDA: decode through the captured step (cuda-graph: the eager step recorded as "
                             "CUDA graphs)")
    parser.add_argument("--train-counts", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> str:
    args = parse(argv)
    if args.train_counts:  # the child process of report()
        print(json.dumps(all_train_counts()))
        return ""
    text = report() if args.device == "cpu" else cuda_report(args.dtype, args.compile)
    return publish(text, args.out)


if __name__ == "__main__":
    main()
