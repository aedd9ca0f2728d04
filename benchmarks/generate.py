"""Greedy generation of a dense model: looplm against transformers' LLaMA holding the same weights.

One run times, at batch 1 and batch 8, greedy generation of ``--new-tokens`` tokens after a
``--prompt-len`` prompt by the same 12-layer, d_model 1024 LLaMA-shaped model (RMSNorm,
SwiGLU, rotary, no loop, untied head; random weights from a fixed seed) five ways:

* ``looplm eager``: ``LoopLM.generate``;
* ``looplm compiled``: ``LoopLM.generate(..., compile=True)``, the captured static-cache
  decode step (skipped, and said so, where this looplm's ``generate`` has no ``compile``);
* ``looplm CUDA graph``: ``LoopLM.generate(..., compile="cuda-graph")``, the eager step on the
  static cache recorded as a CUDA graph (no torch.compile; on a CPU the static step, eager);
* ``transformers eager``: ``LlamaForCausalLM.generate`` with its default dynamic cache;
* ``transformers static + compile``: the same with ``cache_implementation="static"``, which
  makes transformers' ``generate`` compile the decoding forward itself (its ``CompileConfig``
  defaults: ``torch.compile(mode="reduce-overhead")``, CUDA graphs on a GPU; on CPU
  ``_compile_all_devices`` is set so that it compiles there too).

The weights are drawn by transformers' own init (``LlamaForCausalLM(config)`` after
``torch.manual_seed(--seed)``) and mapped into looplm by its importer,
``looplm.hf.import_model.state_dict_from_hf`` (the mapping ``looplm import`` uses). Before any
timing the two models' logits on the prompt are compared in fp32 on the device (the run
stops if they differ beyond float rounding) and the largest difference is printed, then in
the run's dtype (reported, not checked: bf16 rounding differs between the two graphs).

Each (system, batch) is run ``--warmup`` times untimed (compilation, CUDA graph capture,
autotuning), then ``--repeats`` times timed; ms per token = the median call's wall time /
``--new-tokens`` (the prompt's prefill included: keep the prompt short). The last column
counts how many generated tokens equal transformers eager's (greedy argmax near-ties can
flip under bf16 rounding; in fp32 they should all agree). ``--dtype bf16`` (default on CUDA)
casts both models' parameters.

    python benchmarks/generate.py --device cuda --out
    python benchmarks/generate.py --device cpu --layers 2 --d-model 64 --heads 4 --vocab 512 --new-tokens 8
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

import torch

from publish import publish

SYSTEMS = ("looplm eager", "looplm compiled", "looplm CUDA graph", "transformers eager",
           "transformers static + compile")
BASELINE = "transformers eager"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def llama_pair(args: argparse.Namespace, device: torch.device):
    """(looplm model, transformers LlamaForCausalLM) with the same weights, fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from looplm import LoopLM
    from looplm.hf.import_model import config_from_hf, state_dict_from_hf

    hf_config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.mlp_hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.prompt_len + args.new_tokens, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,  # no stop token: every call makes --new-tokens
    )
    torch.manual_seed(args.seed)
    with torch.device(device):
        hf = LlamaForCausalLM(hf_config)
    cfg = config_from_hf(hf_config.to_dict())
    with torch.device(device):
        model = LoopLM(cfg)
    model.load_state_dict(state_dict_from_hf(hf.state_dict(), cfg, "llama"), strict=True)
    hf.generation_config.eos_token_id = None
    return model.eval(), hf.eval()


@torch.no_grad()
def logit_difference(model, hf, ids: torch.Tensor) -> tuple[float, float]:
    """(largest |looplm - transformers| logit on ``ids``, largest |logit|)."""
    ours, theirs = model(ids).logits.float(), hf(ids).logits.float()
    return (ours - theirs).abs().max().item(), theirs.abs().max().item()


def check_same_logits(model, hf, ids: torch.Tensor) -> str:
    """Compare in fp32 (raises if beyond float rounding), then in the run's dtype (reported)."""
    diff, scale = logit_difference(model, hf, ids)
    line = f"max |logit difference| on the prompt: fp32 {diff:.2e} (logits up to {scale:.2f})"
    if diff > 1e-3 * (1 + scale):  # float rounding of two graphs (fused QKV, op order); a mapping error is O(scale)
        raise SystemExit(f"looplm and transformers disagree: {line}; the benchmark would compare different models")
    return line


def generators(model, hf, args: argparse.Namespace) -> dict[str, Optional[Callable]]:
    """system -> a call generating ``args.new_tokens`` tokens for a prompt (None: unavailable)."""
    from transformers import CompileConfig

    n = args.new_tokens
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only unless told

    def looplm(**options):
        return lambda ids: model.generate(ids, max_new_tokens=n, temperature=0.0, **options).sequences

    def transformers(**options):
        return lambda ids: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                       pad_token_id=0, **options)

    has_compile = "compile" in inspect.signature(model.generate).parameters
    return {
        "looplm eager": looplm(),
        "looplm compiled": looplm(compile=True) if has_compile else None,
        "looplm CUDA graph": looplm(compile="cuda-graph") if has_compile else None,
        "transformers eager": transformers(disable_compile=True),
        "transformers static + compile": transformers(cache_implementation="static", compile_config=compile_config),
    }


def time_calls(generate: Callable, ids: torch.Tensor, args: argparse.Namespace) -> tuple[float, torch.Tensor]:
    """(median seconds of ``args.repeats`` timed calls after ``args.warmup`` untimed ones, the
    last call's sequences)."""
    def call() -> tuple[float, torch.Tensor]:
        sync(ids.device)
        start = time.perf_counter()
        sequences = generate(ids)
        sync(ids.device)
        return time.perf_counter() - start, sequences

    for _ in range(args.warmup):
        call()
    times, sequences = [], None
    for _ in range(args.repeats):
        seconds, sequences = call()
        times.append(seconds)
    expected = (ids.shape[0], ids.shape[1] + args.new_tokens)
    if tuple(sequences.shape) != expected:
        raise RuntimeError(f"generated sequences of shape {tuple(sequences.shape)}, expected {expected}")
    return statistics.median(times), sequences


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace, on_row: Callable[[dict, list[str]], None]) -> tuple[list[dict], list[str]]:
    """Every (batch, system) row; ``on_row(rows, notes)`` after each (the caller rewrites its report)."""
    device = torch.device(args.device)
    model, hf = llama_pair(args, device)
    torch.manual_seed(args.seed)
    prompts = {b: torch.randint(0, args.vocab, (b, args.prompt_len), device=device) for b in args.batches}
    notes = [check_same_logits(model, hf, prompts[args.batches[0]])]
    model.to(DTYPES[args.dtype])
    hf.to(DTYPES[args.dtype])
    if args.dtype != "fp32":
        diff, scale = logit_difference(model, hf, prompts[args.batches[0]])
        notes[0] += f", {args.dtype} {diff:.2e} (logits up to {scale:.2f})"
    print(notes[0], file=sys.stderr, flush=True)
    calls = generators(model, hf, args)
    rows: list[dict] = []
    for batch in args.batches:
        reference = None
        for system in sorted(args.systems, key=lambda s: s != BASELINE):  # the baseline's tokens first
            row = {"system": system, "batch": batch}
            if calls[system] is None:
                row["skipped"] = "this looplm's generate() has no compile parameter"
            else:
                try:
                    seconds, sequences = time_calls(calls[system], prompts[batch], args)
                    row["seconds"] = seconds
                    if system == BASELINE:
                        reference = sequences
                    if reference is not None:
                        row["same_tokens"] = int((sequences[:, args.prompt_len:] == reference[:, args.prompt_len:]).sum())
                    if system == "transformers static + compile":
                        row["compiled"] = hasattr(hf, "_compiled_call")  # transformers' get_compiled_call ran
                except Exception as error:  # noqa: BLE001 - one failing system must not end the run
                    traceback.print_exc()
                    row["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
            rows.append(row)
            on_row(rows, notes)
    return rows, notes


def card(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()} {platform.processor()})".replace(" )", ")")


def report(args: argparse.Namespace, rows: list[dict], notes: list[str], argv: list[str]) -> str:
    import transformers

    device = torch.device(args.device)
    n = args.new_tokens
    lines = [
        "# Greedy generation: looplm against transformers' LLaMA, same weights",
        "",
        f"Command: `{shlex.join(['python', 'benchmarks/generate.py', *argv])}`  ",
        f"Card: {card(device)}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, {torch.get_num_threads()} CPU threads, load average "
        f"{os.getloadavg()[0]:.1f} when written.  ",
        f"Model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, SwiGLU {args.mlp_hidden}, "
        f"vocabulary {args.vocab}, untied head; random weights (seed {args.seed}); {args.dtype} "
        f"(parameters cast{'' if args.dtype != 'fp32' else ': none'}).  ",
        f"Each call: a {args.prompt_len}-token prompt, {n} new tokens, greedy; median of {args.repeats} timed calls "
        f"after {args.warmup} untimed; ms/token = call time / {n} (prefill included).  ",
        f"{notes[0]}.",
        "",
        "| batch | system | ms/token | tokens/s | vs transformers eager | tokens as transformers eager |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    baseline = {r["batch"]: r["seconds"] for r in rows if r["system"] == BASELINE and "seconds" in r}
    for r in rows:
        if "seconds" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
            lines.append(f"| {r['batch']} | {r['system']} | - | - | - | {why} |")
            continue
        vs = f"{baseline[r['batch']] / r['seconds']:.2f}x" if r["batch"] in baseline else "-"
        same = f"{r['same_tokens']}/{r['batch'] * n}" if "same_tokens" in r else "-"
        system = r["system"] + (" (transformers did not compile)" if r.get("compiled") is False else "")
        lines.append(f"| {r['batch']} | {system} | {1e3 * r['seconds'] / n:.2f} | {r['batch'] * n / r['seconds']:,.0f} "
                     f"| {vs} | {same} |")
    return "\n".join(lines) + "\n"


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--mlp-hidden", type=int, default=None, help="SwiGLU width (default LLaMA's 8/3 d rounded up to 256)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS, metavar="SYSTEM")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per row (compilation, graph capture)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per row; the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads")
    p.add_argument("--out", nargs="?", const="", default=None,
                   help="write the table (alone: benchmarks/results/generate-DEVICE.md)")
    args = p.parse_args(argv)
    for name in ("layers", "d_model", "heads", "vocab", "prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if min(args.batches) < 1:
        p.error(f"--batches {args.batches}: each must be at least 1")
    if args.d_model % args.heads:
        p.error(f"--heads {args.heads}: must divide --d-model {args.d_model}")
    args.mlp_hidden = args.mlp_hidden or -(-8 * args.d_model // 3 // 256) * 256
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    return args


def main(argv: Optional[list[str]] = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    out = None
    if args.out is not None:
        out = args.out or f"benchmarks/results/generate-{torch.device(args.device).type}.md"

    def on_row(rows: list[dict], notes: list[str]) -> None:
        print(f"[generate] {rows[-1]}", file=sys.stderr, flush=True)
        # rewritten after every row: a run stopped at a deadline keeps what it measured
        publish(report(args, rows, notes, argv), out, echo=False)

    rows, notes = measure(args, on_row)
    print(report(args, rows, notes, argv))
    return rows


if __name__ == "__main__":
    main()
