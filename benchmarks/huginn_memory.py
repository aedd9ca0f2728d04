"""Huginn's truncated backpropagation: training memory follows the window k, not the drawn
recurrence count r (arXiv 2502.05171 §3.3; issue 27's benchmark).

A Huginn-shaped model (prelude 2, core 4, coda 2, ``concat_adapter`` topology, RMSNorm,
SwiGLU, sandwich norms, √d embedding scale) runs one training forward + backward at
r = 4, 8, 16, 32 iterations with ``model.depth.backprop_window`` = k, and the same with full
backpropagation. Memory is measured as the bytes autograd saves for the backward (every
tensor packed by ``torch.autograd.graph.saved_tensors_hooks``, counted each time it is
saved): a deterministic count, the same on every machine, that dominates a training step's
activation memory. On CUDA the peak allocated memory of the step is reported beside it.

    python benchmarks/huginn_memory.py --out benchmarks/results/huginn-memory-cpu.md
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from looplm import LoopLM
from looplm.model_config import ModelConfig
from publish import publish


def build(args, window) -> LoopLM:
    cfg = ModelConfig(
        vocab_size=args.vocab, d_model=args.d_model, n_heads=args.heads, layout="2+4R4+2", norm="rmsnorm",
        mlp="swiglu", bias=False, norm_placement="sandwich", embed_scale=True, max_seq_len=args.seq_len,
        topology={"kind": "concat_adapter"}, depth={"kind": "lognormal_poisson", "backprop_window": window},
    )
    torch.manual_seed(0)
    return LoopLM(cfg).to(args.device).train()


def measure(model: LoopLM, ids: torch.Tensor, r: int) -> tuple[int, int | None]:
    """(bytes saved for the backward, peak CUDA memory in bytes or None) of one step at r."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, ids, iterations=r).loss
    loss.backward()
    peak = None
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    return saved[0], peak


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--window", type=int, default=8, help="k, the iterations backpropagated through")
    p.add_argument("--counts", type=int, nargs="+", default=[4, 8, 16, 32], help="r, the iterations run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    rows = []
    for label, window in ((f"k = {args.window}", args.window), ("full backprop", None)):
        model = build(args, window)
        base = None
        for r in args.counts:
            saved, peak = measure(model, ids, r)
            base = base or saved
            rows.append((label, r, saved, saved / base, peak))
        del model
    lines = [
        "# Huginn truncated backprop: memory against the recurrence count",
        "",
        f"Command: `python benchmarks/huginn_memory.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
        f"Machine: {platform.machine()}, torch {torch.__version__}, device {args.device}, fp32. Model: 2+4R·+2, "
        f"concat_adapter, d={args.d_model}, H={args.heads}, V={args.vocab}; batch {args.batch} × {args.seq_len} "
        "tokens; one forward + backward. Saved bytes: every tensor autograd packs for the backward.",
        "",
        "| backprop | r | saved for backward (MiB) | ratio to the first r | peak CUDA memory (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, r, saved, ratio, peak in rows:
        peak_text = "–" if peak is None else f"{peak / 2**20:.1f}"
        lines.append(f"| {label} | {r} | {saved / 2**20:.1f} | {ratio:.2f} | {peak_text} |")
    return publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
