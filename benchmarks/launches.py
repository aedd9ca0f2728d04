"""What a step launches, counted on CPU (DESIGN.md invariant 6): the targets of issues 25
and 30 in one table each, measured side by side in one run.

* decoding: dispatched operators per decoded token per block pass and host syncs per
  token, through the public ``generate`` (17 minus 1 new tokens, greedy, batch 2), for the
  LT2 tiny presets the long-context benchmark compares;
* training: dispatched operators and host syncs of one forward + backward at d = 64 through
  the public model, for ``benchmarks/train_throughput.py``'s variants (SGT grown as that
  benchmark grows it), with each issue-25 ratio against its target.

Views, allocations and metadata-only operators are not counted
(``looplm.accounting.dispatch``). The counts are the eager path's: a GPU runs the same
operators as kernels, except where a fused CUDA kernel replaces several (``F.rms_norm``:
one kernel for six CPU operators). The tests keep each count from growing back.

    python benchmarks/launches.py [--out benchmarks/results/launches-cpu.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_throughput as throughput  # noqa: E402

from looplm import LoopLM, load_config  # noqa: E402
from looplm.accounting.dispatch import count_dispatch  # noqa: E402

#: decoding: model -> (preset, issue 30's target in operators per decoded token per block pass)
DECODE = {
    "looped transformer": ("tiny-lt2-transformer", 24),
    "looped GDN": ("tiny-lt2-gdn", 30),
    "Full+GDN hybrid": ("tiny-lt2-hybrid-full-gdn", 30),
    "GDN+DSA hybrid": ("tiny-lt2-hybrid-gdn-dsa", 45),
}
#: training: (variant, reference variant, issue 25's target for ops(variant) / ops(reference))
TRAIN_RATIOS = [("mesh", "base", 1.05), ("spiral", "spiral-full", 1.00), ("sgt", "dense", 1.40)]


def decode_counts(preset: str) -> tuple[float, float]:
    torch.manual_seed(0)
    model = LoopLM(load_config(preset).model).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    one, _ = count_dispatch(lambda: model.generate(ids, max_new_tokens=1, temperature=0))
    many, _ = count_dispatch(lambda: model.generate(ids, max_new_tokens=17, temperature=0))
    return (many.ops - one.ops) / 16 / model.cfg.block_passes, (many.syncs - one.syncs) / 16


def train_counts(variant: str, directory: str):
    args = throughput.parse(["--width", "64", "--seq", "32", "--batch", "2", "--no-compile"])
    model = throughput.build(variant, args, str(Path(directory) / variant), False).model
    ids = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(0))

    def step():
        model(ids[:, :-1], ids[:, 1:]).loss.backward()

    step()  # gradients exist from here on, as in training
    model.zero_grad(set_to_none=True)
    counts, _ = count_dispatch(step)
    return counts


def report() -> str:
    lines = ["# Launch counts (CPU, eager)", "", "Written by `python benchmarks/launches.py`; torch "
             f"{torch.__version__}. Dispatched operators (views, allocations and metadata excluded) and "
             "host syncs, `looplm.accounting.dispatch`.", "",
             "## Decoding (issue 30): per decoded token per block pass, through `generate`", "",
             "| model | preset | operators | target | host syncs per token |", "| --- | --- | --- | --- | --- |"]
    for name, (preset, target) in DECODE.items():
        ops, syncs = decode_counts(preset)
        lines.append(f"| {name} | `{preset}` | {ops:.1f} | ≤ {target} | {syncs:g} |")
    lines += ["", "## Training (issue 25): one forward + backward at d = 64", "",
              "| variant | operators | host syncs |", "| --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        counts = {v: train_counts(v, tmp) for v in ("dense", "base", "mesh", "spiral-full", "spiral", "sgt")}
    for variant, c in counts.items():
        lines.append(f"| {variant} | {c.ops} | {c.syncs} |")
    lines += ["", "| ratio | measured | target |", "| --- | --- | --- |"]
    for variant, reference, target in TRAIN_RATIOS:
        ratio = counts[variant].ops / counts[reference].ops
        lines.append(f"| {variant} / {reference} | {ratio:.3f} | ≤ {target:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = parser.parse_args(argv)
    text = report()
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return text


if __name__ == "__main__":
    main()
