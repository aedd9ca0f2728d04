"""Compile time of ``generate(compile=True)``'s captured decoding step against the loop's
depth (issue 30): with block regions (the default) and unrolled (``{"block_regions": False}``).

``torch.compile`` traces a decoding step by running it: the loop unrolls, and unrolled,
every block pass (100 for LT2 0.6B's 25R4) is traced, optimised and code-generated again;
on an H100 that step did not finish compiling in 60 s. With block regions each pass is one
``torch.compiler.nested_compile_region`` (``looplm.modules.region``): traced once, compiled
once per distinct block kind, stamped out for every other pass, so compile time follows the
number of block kinds, not of passes.

Each row runs in its own process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``
a new temporary directory), so "compile s" is a cold compile: the wall time of the first
``model.generate(ids, max_new_tokens=4, temperature=0, compile=...)``, prefill and 3 steps
included (no compile happens elsewhere in that call). Then ms/token is (fastest of
``--repeats`` calls making 1 + N new tokens - fastest making 1) / N, N = ``--new-tokens``
(the fastest: a shared machine's load only ever adds time), through
the captured step and eagerly; "equal" says whether the compiled and the eager tokens agree
(greedy, fp32); "operators compiled" counts what Dynamo hands the backend: the captured
graph's operators plus each distinct region's once (a load-proof measure of compile work:
the machine's load moves the seconds). Models: LT2 0.6B's looped transformer narrowed to d_model 64, 2 heads,
FFN 128, vocabulary 512 at layouts 5R2, 10R4 and 25R4 (10, 40, 100 block passes), and the
tiny LT2 GDN and Full+GDN presets at 5R2 and 25R4. The CPU numbers time Dynamo, AOTAutograd
and inductor's C++ code generation; a GPU adds Triton compiles per distinct kernel, which
regions share too.

    python benchmarks/compile_time.py [--unrolled-rows transformer:5R2 transformer:25R4] [--out FILE]
    python benchmarks/compile_time.py --device cuda --out benchmarks/results/compile-time-cuda.md
    python benchmarks/compile_time.py --rows transformer:5R2 --backend eager  # Dynamo alone
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from publish import publish

#: row name -> (preset, overrides): the LT2 0.6B looped transformer narrowed, and LT2's tiny presets
MODELS = {
    "transformer": ("lt2-0.6b-transformer", ["model.d_model=64", "model.n_heads=2", "model.mlp_hidden=128",
                                             "model.vocab_size=512", "model.max_seq_len=256"]),
    "gdn": ("tiny-lt2-gdn", ["model.max_seq_len=256"]),
    "full+gdn": ("tiny-lt2-hybrid-full-gdn", ["model.max_seq_len=256"]),
}
ROWS = ["transformer:5R2", "transformer:10R4", "transformer:25R4", "gdn:5R2", "gdn:25R4", "full+gdn:5R2",
        "full+gdn:25R4"]


def config(row: str):
    """The model config of ``model:layout``."""
    from looplm import load_config

    name, layout = row.split(":")
    preset, overrides = MODELS[name]
    return load_config(preset, [*overrides, f"model.layout={layout}"]).model


def build(row: str, device: str):
    from looplm import LoopLM

    cfg = config(row)
    torch.manual_seed(0)
    with torch.device(device):
        model = LoopLM(cfg)
    return model.eval(), cfg


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(row: str, regions: bool, device: str, backend: Optional[str], new_tokens: int, repeats: int) -> dict:
    """One row, in this process (call it in a fresh one: the compile must be cold)."""
    model, cfg = build(row, device)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    handed, compile_graph = [], torch._dynamo.lookup_backend(backend or "inductor")

    def recording(graph: torch.fx.GraphModule, example_inputs):
        handed.append(backend_operators(graph))
        return compile_graph(graph, example_inputs)

    fell_back = _Warnings()
    logging.getLogger("looplm.generation").addHandler(fell_back)

    options = {"block_regions": regions, "backend": recording}

    def timed(tokens: int, compile) -> tuple[float, torch.Tensor]:
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, temperature=0, compile=compile)
        _sync(device)
        return time.perf_counter() - start, out.sequences

    compile_s, _ = timed(4, options)

    def per_token(compile) -> tuple[float, torch.Tensor]:
        longs, shorts, tokens = [], [], None
        for _ in range(repeats):
            long, tokens = timed(1 + new_tokens, compile)
            longs.append(long)
            shorts.append(timed(1, compile)[0])
        return (min(longs) - min(shorts)) / new_tokens * 1e3, tokens

    compiled_ms, compiled = per_token(options)
    eager_ms, eager = per_token(False)
    if fell_back.messages:  # the step was not captured as asked: its times measure something else
        return dict(row=row, regions=regions, error=" ".join(fell_back.messages[0].split())[:200])
    return dict(row=row, passes=cfg.block_passes, regions=regions, compile_s=compile_s, compiled_ms=compiled_ms,
                eager_ms=eager_ms, equal=bool(torch.equal(compiled, eager)), operators=sum(handed))


class _Warnings(logging.Handler):
    """Keeps the warnings logged (generate's fallbacks from the captured step)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def backend_operators(graph: torch.fx.GraphModule) -> int:
    """Operators the backend compiles for a captured graph: its own calls and those of each
    distinct nested subgraph (a region), once however many passes call it."""
    def calls(module: torch.fx.GraphModule) -> int:
        return sum(1 for node in module.graph.nodes if node.op == "call_function")

    called = {node.args[0].target for node in graph.graph.nodes
              if node.target is torch.ops.higher_order.invoke_subgraph}
    return calls(graph) + sum(calls(getattr(graph, name)) for name in called)


def run_fresh(row: str, regions: bool, args: argparse.Namespace) -> dict:
    """:func:`measure` in a new process with an empty inductor cache."""
    command = [sys.executable, __file__, "--child", row, "--device", args.device, "--new-tokens",
               str(args.new_tokens), "--repeats", str(args.repeats)] + (["--unrolled"] if not regions else []) \
        + (["--backend", args.backend] if args.backend else [])
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent / "src"), os.environ.get("PYTHONPATH", "")]))
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return dict(row=row, regions=regions, error=f"timed out at {args.timeout} s")
    if done.returncode:
        return dict(row=row, regions=regions, error=" ".join(done.stderr.split())[-300:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    lines = ["| model | layout | block passes | block regions | operators compiled | compile s | compiled ms/token "
             "| eager ms/token | equal |", "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        name, layout = r["row"].split(":")
        regions = "on" if r["regions"] else "off (unrolled)"
        if "error" in r:
            lines.append(f"| {name} | {layout} | | {regions} | | {r['error']} | | | |")
            continue
        lines.append(f"| {name} | {layout} | {r['passes']} | {regions} | {r.get('operators', '')} | {r['compile_s']:.1f} | "
                     f"{r['compiled_ms']:.2f} | {r['eager_ms']:.2f} | {'yes' if r['equal'] else 'NO'} |")
    return "\n".join(lines)


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=ROWS, help="model:layout, model one of " + ", ".join(MODELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default inductor)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per row")
    parser.add_argument("--unrolled-rows", nargs="*", default=None,
                        help="the rows also compiled unrolled (default: every row; the deep ones take minutes)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--unrolled", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> str:
    args = parse(argv)
    if args.child:
        print(json.dumps(measure(args.child, not args.unrolled, args.device, args.backend, args.new_tokens,
                                 args.repeats)))
        return ""
    results = []
    for row in args.rows:
        for regions in (True, False):
            if not regions and args.unrolled_rows is not None and row not in args.unrolled_rows:
                continue
            results.append(run_fresh(row, regions, args))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    text = (f"# Compile time of the captured decoding step\n\n`python benchmarks/compile_time.py "
            f"{' '.join(sys.argv[1:])}`\n\n{platform.platform()}, torch {torch.__version__}, device "
            f"{args.device}, backend {args.backend or 'inductor'}, {torch.get_num_threads()} threads, load average "
            f"{os.getloadavg()[1]:.1f} over the last 5 minutes at the end (the seconds move with it; the operators do "
            f"not)\n\n"
            f"{table(results)}\n")
    return publish(text, args.out)


if __name__ == "__main__":
    main()
