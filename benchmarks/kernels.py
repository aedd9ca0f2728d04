"""looplm's Triton training kernels at the GPU benchmark's size, each under a small grid of
launch configurations timed side by side: MeSH's write-read forward and backward
(``looplm.ops.write_read_triton``: positions per program x warps) and SpiralFormer's down-
and up-scaling forward and backward (``looplm.ops.resolution_triton``: warps per chunk).

Every one of these kernels is memory-bound, so each row gives GB/s (the bytes its
arguments and results hold, each counted once) beside a device-to-device copy measured in
the same run (what the memory system gives a plain read and write). The default launch
(what the ops pick today) is marked; every other configuration's results are checked
against the default's (max abs difference; a reduction split over other warps may round
differently), so a better default is read off one run. The report is rewritten after each
kernel: a run cut at its deadline keeps the kernels it finished.

Sizes (``benchmarks/train_throughput.py``'s at the issue's width): batch 8 x 1024 tokens,
d = 1024, bf16; MeSH at its third write-read of ``2+2R2+2`` (J = 2 values written before,
5 slots), SpiralFormer-B's 1/8 stage (chunks of 8, its allocation router and
self-aggregation). ``--small`` shrinks them for a CPU run under ``TRITON_INTERPRET=1``
(the configurations' agreement only: nothing is timed there).

    python benchmarks/kernels.py --device cuda --out benchmarks/results/kernels-cuda.md
    TRITON_INTERPRET=1 python benchmarks/kernels.py --small
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from unittest import mock

import torch

from publish import publish

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Kernel:
    """One op to time: ``op(*args)`` (its launch chosen by ``module._blocks``), and the
    configurations to try, each overriding part of the default launch dict."""

    name: str
    module: Any
    op: Callable[..., Any]
    args: tuple
    launches: list[dict[str, int]]
    rows: list[dict[str, Any]] = field(default_factory=list)

    def call(self):
        return self.op(*self.args)


def tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    return []


def sampler(device: str, dtype: torch.dtype, seed: int) -> Callable[..., torch.Tensor]:
    """randn(*shape, scale=1.0): seeded normal samples in ``dtype`` on ``device``."""
    generator = torch.Generator(device).manual_seed(seed)
    return lambda *shape, scale=1.0: (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)


def _mesh(small: bool, device: str, dtype: torch.dtype) -> list[Kernel]:
    from looplm.ops import write_read_triton as wr

    B, T, d, J, S = (2, 4, 48, 2, 5) if small else (8, 1024, 1024, 2, 5)
    randn = sampler(device, dtype, seed=0)

    state, update, values = randn(B, T, d), randn(B, T, d), randn(B, T, J, d)
    weights = torch.softmax(randn(B, T, J, S).float(), -1).to(dtype)
    routers = [randn(S, d, scale=d**-0.5), randn(S), randn(S, d, scale=d**-0.5), randn(S)]
    _, values_out, weights_out, probs, coef = wr.write_read(state, update, values, weights, *routers)
    grads = randn(B, T, d), randn(B, T, J + 1, d), randn(B, T, J + 1, S)
    backward_args = (state, routers[0], routers[2], probs, weights_out, values_out, coef, dtype, False)
    # (the interpreter ignores warps: --small tries the positions per program only)
    launches = [{"BN": bn, "num_warps": w} for bn in ([1, 2] if small else [1, 2, 4])
                for w in ([4] if small else [4, 8])]
    return [Kernel("MeSH write-read, forward", wr, wr.write_read, (state, update, values, weights, *routers), launches),
            Kernel("MeSH write-read, backward", wr, wr.write_read_backward, (*grads, *backward_args), launches)]


def _resolution(small: bool, device: str, dtype: torch.dtype) -> list[Kernel]:
    from looplm.ops import resolution_triton as rt

    B, T, d, chunk = (2, 16, 48, 4) if small else (8, 1024, 1024, 8)
    lead, n = chunk - 1, T // chunk  # chunk 0 holds chunk - 1 empty slots (the causal grid)
    randn = sampler(device, dtype, seed=1)

    tokens, latents = randn(B, T, d), randn(B, n, d)
    scorer, router = (randn(1, d, scale=d**-0.5), randn(1)), (randn(chunk, d, scale=d**-0.5), randn(chunk))
    gain = chunk**0.5
    _, alpha = rt.aggregate(tokens, *scorer, lead, n, chunk)
    _, beta = rt.allocate(latents, *router, chunk, gain, chunk - 1, 0, T)
    grad_z, grad_u = randn(B, n, d), randn(B, T, d)
    launches = [{"num_warps": w} for w in ((2,) if small else (4, 8, 16))]
    return [
        Kernel("SpiralFormer self-aggregation, forward", rt, rt.aggregate, (tokens, *scorer, lead, n, chunk), launches),
        Kernel("SpiralFormer self-aggregation, backward", rt, rt.aggregate_backward,
               (grad_z, tokens, scorer[0], alpha, lead), launches),
        Kernel("SpiralFormer allocation router, forward", rt, rt.allocate,
               (latents, *router, chunk, gain, chunk - 1, 0, T), launches),
        Kernel("SpiralFormer allocation router, backward", rt, rt.allocate_backward,
               (grad_u, latents, router[0], beta, gain, chunk - 1, 0), launches),
    ]


def timer(device: str) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of ``fn`` (triton.testing.do_bench) on a GPU; NaN elsewhere (the
    interpreter runs the kernels' arithmetic, not their speed)."""
    if device.startswith("cuda"):
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    return lambda fn: float("nan")


def run_kernel(kernel: Kernel, measure: Callable[[Callable[[], Any]], float]) -> None:
    """Time every launch of ``kernel``, the default first, each checked against the default's results."""
    default, seen = kernel.module._blocks, []

    def record(*args):  # what the op asks its module's _blocks: the default launch
        seen.append(args)
        return default(*args)

    with mock.patch.object(kernel.module, "_blocks", record):
        reference = tensors(kernel.call())
    base = default(*seen[0])
    tried = []
    for override in [{}] + kernel.launches:
        launch = {**base, **override}
        if launch in tried:
            continue  # the default again
        tried.append(launch)
        with mock.patch.object(kernel.module, "_blocks", lambda *args, launch=launch: launch):
            try:
                out = tensors(kernel.call())
                ms = measure(kernel.call)
            except Exception as err:  # noqa: BLE001 - a launch the compiler or device refuses: its row says so
                kernel.rows.append(dict(launch=launch, default=not override,
                                        error=f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"))
                continue
        diff = max((float((a.float() - b.float()).abs().max()) if a.numel() else 0.0) for a, b in zip(out, reference))
        moved = sum(t.numel() * t.element_size() for t in tensors(kernel.args) + out)
        kernel.rows.append(dict(launch=launch, default=not override, ms=ms, gbps=moved / ms / 1e6, diff=diff))


def copy_bandwidth(device: str, dtype: torch.dtype, measure, numel: int) -> float:
    """GB/s of a device-to-device copy of ``numel`` elements (read and write counted)."""
    src = torch.randn(numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def report(args, kernels: list[Kernel], copy_gbps: float, argv: list[str]) -> str:
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    lines = ["# looplm's Triton kernels: launch configurations", "",
             f"Command: `python benchmarks/kernels.py {' '.join(argv)}`  ",
             f"Device: {device}; torch {torch.__version__}; {args.dtype}"
             f"{'; TRITON_INTERPRET=1 (not timed)' if os.environ.get('TRITON_INTERPRET') == '1' else ''}.  ",
             "Device-to-device copy in the same run: " + ("not timed" if math.isnan(copy_gbps) else
                                                          f"{copy_gbps:,.0f} GB/s (read + write)") + ".", ""]
    for kernel in kernels:
        lines += [f"## {kernel.name}", "",
                  "| launch | default | ms (median) | GB/s | vs copy | max abs diff to default |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        for row in kernel.rows:
            launch = ", ".join(f"{k}={v}" for k, v in row["launch"].items())
            mark = "yes" if row["default"] else ""
            if "error" in row:
                lines.append(f"| {launch} | {mark} | failed: `{row['error']}` | | | |")
            elif math.isnan(row["ms"]):  # not timed (CPU)
                lines.append(f"| {launch} | {mark} | - | - | - | {row['diff']:.2e} |")
            else:
                lines.append(f"| {launch} | {mark} | {row['ms']:.4f} | {row['gbps']:,.0f} | "
                             f"{row['gbps'] / copy_gbps:.2f} | {row['diff']:.2e} |")
        lines.append("")
    return "\n".join(lines)


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--small", action="store_true", help="tiny sizes (CPU, TRITON_INTERPRET=1)")
    p.add_argument("--only", nargs="*", default=None, help="kernels whose name contains one of these words")
    p.add_argument("--out", default=None, help="write the markdown report here (printed either way)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> list[Kernel]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if not args.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("kernels.py runs on a CUDA device, or on CPU under TRITON_INTERPRET=1 (with --small)")
    dtype, measure = DTYPES[args.dtype], timer(args.device)
    kernels = _mesh(args.small, args.device, dtype) + _resolution(args.small, args.device, dtype)
    if args.only:
        kernels = [k for k in kernels if any(word.lower() in k.name.lower() for word in args.only)]
    copy_gbps = copy_bandwidth(args.device, dtype, measure, 8 * 1024 * 1024 if not args.small else 4096)
    done: list[Kernel] = []
    text = ""
    for kernel in kernels:
        run_kernel(kernel, measure)
        done.append(kernel)
        text = report(args, done, copy_gbps, argv)
        publish(text, args.out, echo=False)  # after each kernel: a run cut at its deadline keeps what it timed
        print(f"[kernels] {kernel.name}: {len(kernel.rows)} launches", file=sys.stderr, flush=True)
    print(text)
    return kernels


if __name__ == "__main__":
    main()
