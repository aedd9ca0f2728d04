"""SGT head looping vs Block Loop vs vanilla: measured training step time next to the
FLOP overhead the counter reports (issue 4's benchmark), side by side in one run.

One small LLaMA-style model (RMSNorm, SwiGLU, MHA, no biases) is built once per variant
with the same weights; the grown structure is written into its blocks as growth leaves it
after freezing: SGT K_max = 1..3 on L = 3 layers (the deepest eligible ones) with h = 2
heads at depth K_max; Block Loop the same 3 layers re-applied once. Each variant times
forward + backward + AdamW step (median of ``--steps`` after ``--warmup``), and reports
its training FLOPs (``default`` convention, causal attention) relative to vanilla and the
operators one forward + backward dispatches (``looplm.accounting.dispatch``: what a
launch-bound GPU step pays per kernel).

    python benchmarks/sgt.py --threads 4
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch

from looplm import LoopLM
from looplm.accounting import count_flops
from looplm.accounting.dispatch import count_dispatch
from looplm.model_config import ModelConfig
from publish import publish


def variants(max_depth: int) -> list[tuple[str, dict, int]]:
    """(name, head_loop config or None, depth)."""
    out = [("vanilla", None, 0), ("block-loop", {"kind": "block", "max_depth": 1}, 1)]
    out += [(f"sgt-k{k}", {"kind": "heads", "heads": 2, "max_depth": k}, k) for k in range(1, max_depth + 1)]
    return out


def build(args, head_loop, depth) -> LoopLM:
    cfg = ModelConfig(
        vocab_size=args.vocab, d_model=args.d_model, n_heads=args.heads, layout=str(args.layers),
        norm="rmsnorm", mlp="swiglu", bias=False, max_seq_len=args.seq_len, head_loop=head_loop,
    )
    torch.manual_seed(0)
    model = LoopLM(cfg)
    if head_loop is not None:
        blocks = model.blocks()
        for layer in range(len(blocks) - 3, len(blocks)):  # L = 3, deepest first (deep-to-shallow)
            weights = None if head_loop["kind"] == "block" else [1.0, 1.0] + [0.0] * (args.heads - 2)
            blocks[layer].head_loop.set(depth, weights)
    return model


def time_steps(model: LoopLM, args) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = model(x[:, :-1], x[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def dispatched_ops(model: LoopLM, args) -> int:
    """Operators of one training forward + backward (gradients zeroed to None first)."""
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    counts, _ = count_dispatch(lambda: model(x[:, :-1], x[:, 1:]).loss.backward())
    model.zero_grad(set_to_none=True)
    return counts.ops


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-depth", type=int, default=3)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/sgt-cpu.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    rows = []
    for name, head_loop, depth in variants(args.max_depth):
        model = build(args, head_loop, depth)
        flops = count_flops(model, args.seq_len, batch=args.batch, convention="default").training
        rows.append((name, time_steps(model, args), flops, dispatched_ops(model, args)))
    base_t, base_f, base_ops = rows[0][1], rows[0][2], rows[0][3]
    lines = [
        "# SGT vs Block Loop vs vanilla: training step time and FLOP overhead (CPU)",
        "",
        f"Command: `python {' '.join(sys.argv)}`  ",
        f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} threads, fp32. Model: LLaMA-style d={args.d_model}, H={args.heads}, "
        f"{args.layers} layers, V={args.vocab}; batch {args.batch} × {args.seq_len} tokens; "
        f"median of {args.steps} steps (fwd+bwd+AdamW) after {args.warmup} warm-up. Grown structure: "
        "the 3 deepest layers, SGT h = 2 heads at depth K, Block Loop whole blocks once.",
        "",
        "| variant | step time (ms) | time overhead | training FLOPs (counter, `default`) | FLOP overhead "
        "| time/FLOP overhead ratio | dispatched ops (fwd+bwd) | vs vanilla |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, t, f, ops in rows:
        dt, df = t / base_t - 1, f / base_f - 1
        ratio = f"{dt / df:.2f}" if df > 0 else "–"
        lines.append(f"| {name} | {1e3 * t:.1f} | {100 * dt:+.2f} % | {f:.4e} | {100 * df:+.2f} % | {ratio} "
                     f"| {ops} | {ops / base_ops:.2f} |")
    text = "\n".join(lines) + "\n"
    publish(text, args.out)


if __name__ == "__main__":
    main()
