"""fla's gated backward against looplm's float32 PyTorch ops, on this GPU (looplm.ops.fla_hopper).

For each gated mixer kind (GDN first: the one issue 25's GDN target is about), its op at the
head widths of the training-throughput shape runs forward and backward through fla and
through the PyTorch op; the table gives the largest relative error over the output and every
gradient, and whether looplm lets the op train on fla here. Where fla refuses its gated
backward (Hopper, Triton >= 3.4.0 and < 3.7.1, no tilelang) the scalar-gated ops run fla's
dq/dk kernel at 128-wide tiles (``use_wide_tiles``); elsewhere fla runs as it ships. Each
row is written as it finishes, so a run stopped at its deadline keeps what it measured.

    python benchmarks/fla_check.py --out benchmarks/results/fla-check-cuda.md
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from publish import publish

#: mixer kinds in the order checked
KINDS = ("gated_deltanet", "kda", "mamba2", "retnet", "gla", "hgrn2")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512, help="d_model the layers are sized for")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp32"])
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    from looplm.mixers import MixerConfig
    from looplm.model_config import ModelConfig
    from looplm.ops import fla_hopper
    from looplm.ops.backend import fla_guard_allows, fla_installed

    if not (torch.cuda.is_available() and fla_installed()):
        sys.exit("fla_check.py needs a CUDA device and flash-linear-attention")
    import fla
    import triton

    device = torch.device("cuda")
    guard = fla_guard_allows(device)
    if not guard:
        fla_hopper.use_wide_tiles()
    shape = ModelConfig(d_model=args.width, n_heads=max(4, args.width // 64), layout="1", bias=False).block_shape
    lines = [
        "# fla's gated backward against the PyTorch ops on this GPU",
        "",
        f"Command: `python benchmarks/fla_check.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
        f"Card: {torch.cuda.get_device_name(device)}; torch {torch.__version__}, Triton {triton.__version__}, "
        f"flash-linear-attention {fla.__version__}. fla's own guard "
        f"{'allows its gated backward here' if guard else 'refuses its gated backward here (fla #640): the scalar-gated dq/dk kernel runs at 128-wide tiles'}. "
        f"Inputs: batch 2 × 128 positions, random, keys normalised; reference: looplm's float32 chunk ops; "
        f"tolerance {fla_hopper.TOLERANCE} (relative RMS error of the output and every gradient).",
        "",
        "| kind | op | H | K | V | dtype | largest error (where) | trains on | seconds |",
        "| --- | --- | ---: | ---: | ---: | --- | --- | --- | ---: |",
    ]

    def write() -> None:
        publish("\n".join(lines) + "\n", args.out, echo=False)

    write()
    for kind in args.kinds:
        op = MixerConfig.from_dict({"kind": kind}).build(shape).gated_op()
        for name in args.dtypes:
            dtype = torch.bfloat16 if name == "bf16" else torch.float32
            start = time.perf_counter()
            try:
                errors = fla_hopper.backward_errors(op, device, dtype)
                worst = max(errors, key=errors.get)
                found, passed = f"{errors[worst]:.2g} ({worst})", errors[worst] <= fla_hopper.TOLERANCE
            except Exception as error:  # a kernel that fails to compile or run is a row, not the end
                found, passed = f"error: {type(error).__name__}: {str(error).splitlines()[0][:80]}", False
            # looplm's rule (looplm.ops.backend.fla_gated_backward_ok): fla's guard, else this check
            verdict = "fla (as shipped)" if guard else ("fla (checked)" if passed else "PyTorch")
            lines.append(f"| {kind} | {op.family}, {'per channel' if op.channels else 'scalar'} | {op.H} | {op.K} "
                         f"| {op.V} | {name} | {found} | {verdict} | {time.perf_counter() - start:.1f} |")
            print(lines[-1], flush=True)
            write()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
