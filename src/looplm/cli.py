"""The ``looplm`` command line: train, tokenize, eval, lm-eval, niah, generate, export, import, convert, distill, info,
probe, flops, ladder, study, config, presets.

    looplm train [CONFIG] [key=value ...] [--resume [PATH]]
    looplm tokenize SOURCE OUT [--tokenizer SPEC] [--num-proc N] [--text-field F] [--streaming] [--shard-chars C]
    looplm eval RUN_OR_CHECKPOINT [key=value ...] [--corpus NAME=PATH ...] [--stride S] [--json] [--no-verify]
    looplm lm-eval RUN_OR_CHECKPOINT --tasks TASK ... | --suite {mesh,spiralformer,sgt,lt2} [--batch-size B] [--include-path DIR] ...
    looplm niah RUN_OR_CHECKPOINT [--lengths N ...] [--depths PCT ...] [--samples N] [--haystack repeat|essay:PATH] [--out DIR]
    looplm generate RUN_OR_CHECKPOINT --prompt TEXT [--max-new-tokens N] ... [--compile [cuda-graph]] [--no-verify]
    looplm export RUN_OR_CHECKPOINT OUT [--iterations T] [--tokenizer SPEC] [--no-verify]
    looplm import HF_DIR OUT [--tokenizer SPEC]
    looplm convert HF_DIR OUT --layout P+CRT+Q --init {average,select,stepwise} [--lora-rank R] [model.key=value ...]
    looplm distill TEACHER [STUDENT_CONFIG] [key=value ...] [--stage {1,select,2,3,all}] [--resume]
    looplm info CONFIG_OR_RUN [key=value ...] [--json] [--no-verify]
    looplm probe RUN_OR_CHECKPOINT --probe NAME [--data key=value ...] [--samples N] [--out DIR] [--no-verify]
    looplm flops CONFIG [key=value ...] [--seq-len N] [--convention NAME]
    looplm ladder --task {addition,copy,reverse} --budget C [--quick] [--rungs RUNG ...] [key=value ...]
    looplm study NAME [--quick | --paper | --size NAME] [--seeds N] [--out DIR] [--threads N] [--variants A,B] [key=value ...]
    looplm config [CONFIG] [key=value ...]
    looplm presets

CONFIG is a YAML path or a preset name (``looplm presets`` lists them); ``key=value``
overrides dotted fields, e.g. ``model.topology.kind=anchor train.max_steps=100``.
Checkpoints are verified against their manifest before use (``--no-verify`` skips that,
for inspecting a damaged one). An expected failure (a config value, data, a checkpoint,
a file permission, an argument, a diverging run) prints one ``error:`` line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from typing import Callable, Optional, Sequence

from looplm.errors import LoopLMError

log = logging.getLogger("looplm")


def _split_config_and_overrides(items: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """The first item is CONFIG unless it looks like ``key=value``."""
    items = list(items)
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def cmd_train(args: argparse.Namespace) -> int:
    from looplm.config import load_config
    from looplm.train import Trainer
    from looplm.train.distributed import process_group_from_env

    source, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(source, overrides)
    resume = args.resume if args.resume is not None else False
    with process_group_from_env():
        Trainer(cfg, resume=resume, progress=not args.no_progress).fit()
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from looplm.data.tokenize_shards import tokenize_to_shards

    result = tokenize_to_shards(
        args.source, args.out, args.tokenizer, num_proc=args.num_proc, text_field=args.text_field,
        hf_config=args.hf_config, hf_split=args.hf_split, streaming=args.streaming, shard_chars=args.shard_chars,
        progress=not args.no_progress,
    )
    state = "up to date" if result.up_to_date else f"wrote {result.written}, kept {result.kept}"
    sys.stdout.write(f"{result.directory}: {result.shards} shards, {result.documents} documents, {result.tokens} "
                     f"tokens ({state}); train with data.source=shards:{result.directory} "
                     f"data.tokenizer={args.tokenizer}\n")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from looplm.eval.validation import evaluate_run

    if args.corpus:
        return _eval_corpora(args)
    if args.stride is not None or args.window is not None:
        raise LoopLMError("--stride and --window apply to --corpus NAME=PATH evaluation; add --corpus")
    result = evaluate_run(args.run, overrides=args.overrides, batches=args.batches, iterations=args.iterations,
                          batch_size=args.batch_size, step_embeddings=not args.no_step_embeddings,
                          verify=not args.no_verify, exits=args.exit)
    finite = math.isfinite(result["val_loss"])
    if args.json:
        finite_only = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in result.items()}
        sys.stdout.write(json.dumps(finite_only, indent=2) + "\n")  # NaN is not JSON: null
    else:
        for key, value in result.items():
            if key != "exits":
                sys.stdout.write(f"{key:<16} {value}\n")
        for row in result.get("exits", ()):  # compute saved against loss paid, per zero-shot exit
            sys.stdout.write(f"exit {row['exit']:<11} val_loss {row['val_loss']:.4f}  loss_paid {row['loss_paid']:+.4f}  "
                             f"block_passes/token {row['block_passes_per_token']:.2f}  "
                             f"compute_saved {100 * row['compute_saved']:.1f} %\n")
    if not finite:
        log.error("error: val_loss is %s, not a usable evaluation (see the warning above)", result["val_loss"])
        return 2
    return 0


def _eval_corpora(args: argparse.Namespace) -> int:
    from looplm.eval.perplexity import evaluate_corpora, parse_corpus

    if args.batches is not None:
        raise LoopLMError("--batches applies to the held-out split; --corpus scores every document of each corpus")
    corpora = dict(parse_corpus(spec) for spec in args.corpus)
    result = evaluate_corpora(args.run, corpora, overrides=args.overrides, window=args.window, stride=args.stride,
                              batch_size=args.batch_size, iterations=args.iterations,
                              step_embeddings=not args.no_step_embeddings, verify=not args.no_verify)
    rows = result["corpora"].values()
    if args.json:
        def finite(row: dict) -> dict:  # NaN is not JSON: null
            return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}

        corpora = {name: finite(row) for name, row in result["corpora"].items()}
        sys.stdout.write(json.dumps({**result, "corpora": corpora}, indent=2) + "\n")
    else:
        sys.stdout.write(f"checkpoint {result['checkpoint']}  window {result['window']}  stride {result['stride']}\n")
        sys.stdout.write(f"{'corpus':<16} {'docs':>6} {'tokens':>10} {'bytes':>10} {'words':>9} {'loss':>8} "
                         f"{'token_ppl':>10} {'bits/byte':>9} {'word_ppl':>10}\n")
        for row in rows:
            sys.stdout.write(f"{row['name']:<16} {row['documents']:>6} {row['tokens']:>10} {row['bytes']:>10} "
                             f"{row['words']:>9} {row['loss']:>8.4f} {row['token_ppl']:>10.3f} "
                             f"{row['bits_per_byte']:>9.4f} {row['word_ppl']:>10.3f}\n")
    broken = [row["name"] for row in rows if not math.isfinite(row["loss"])]
    if broken:
        log.error("error: the loss on %s is not finite, not a usable evaluation", ", ".join(broken))
        return 2
    return 0


def cmd_lm_eval(args: argparse.Namespace) -> int:
    from looplm.eval.lm_eval import evaluate_tasks, results_table, write_results

    if args.suite is not None:
        return _lm_eval_suite(args)
    results = evaluate_tasks(
        args.run, args.tasks, num_fewshot=args.num_fewshot, batch_size=args.batch_size, iterations=args.iterations,
        step_embeddings=not args.no_step_embeddings, limit=args.limit, include_path=args.include_path,
        max_length=args.max_length, verify=not args.no_verify, seed=args.seed,
    )
    sys.stdout.write(results_table(results) + "\n")
    if args.output is not None:
        write_results(results, args.output)
        sys.stdout.write(f"results: {args.output}\n")
    return 0


def cmd_niah(args: argparse.Namespace) -> int:
    from pathlib import Path

    from looplm.data import data_tokenizer
    from looplm.eval.load import load_run, set_step_embeddings
    from looplm.eval.niah import evaluate_niah, markdown_table, write_results

    run = load_run(args.run, verify=not args.no_verify)
    set_step_embeddings(run.model, not args.no_step_embeddings)
    result = evaluate_niah(
        run.model, data_tokenizer(run.config.data), tasks=args.tasks, lengths=args.lengths, depths=args.depths,
        samples=args.samples, haystack=args.haystack, seed=args.seed, iterations=args.iterations,
        batch_size=args.batch_size,
    )
    out = Path(args.out) if args.out is not None else Path(args.run) / "niah"
    written = write_results(result, out, figures=not args.no_figures)
    sys.stdout.write(markdown_table(result) + "\n" + "".join(f"wrote {path}\n" for path in written))
    return 0


def _lm_eval_suite(args: argparse.Namespace) -> int:
    from pathlib import Path

    from looplm.eval.suites import SUITES, markdown, write_table
    from looplm.eval.lm_eval import evaluate_suite

    if args.num_fewshot is not None:
        raise LoopLMError(f"--num-fewshot does not apply to --suite {args.suite}: the suite runs the paper's shots "
                          f"({', '.join(map(str, SUITES[args.suite].shots))})")
    table, _ = evaluate_suite(
        args.run, SUITES[args.suite], batch_size=args.batch_size, iterations=args.iterations,
        step_embeddings=not args.no_step_embeddings, limit=args.limit, include_path=args.include_path,
        max_length=args.max_length, verify=not args.no_verify, seed=args.seed,
    )
    path = Path(args.output) if args.output is not None else Path(args.run) / "lm-eval" / f"{args.suite}.json"
    written = write_table(table, path)
    sys.stdout.write(markdown(table) + "".join(f"wrote {p}\n" for p in written))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from looplm.eval.text_generation import generate_text

    text = generate_text(
        args.run,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        iterations=args.iterations,
        seed=args.seed,
        step_embeddings=not args.no_step_embeddings,
        verify=not args.no_verify,
        compile=args.compile,
        exit=args.exit,
    )
    sys.stdout.write(text + "\n")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from looplm.hf.export import export

    out = export(args.run, args.out, iterations=args.iterations, tokenizer=args.tokenizer, verify=not args.no_verify)
    sys.stdout.write(f"exported {args.run} -> {out} (AutoModelForCausalLM / AutoTokenizer.from_pretrained)\n")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from looplm.hf.import_run import import_checkpoint

    step = import_checkpoint(args.hf_dir, args.out, tokenizer=args.tokenizer)
    sys.stdout.write(f"imported {args.hf_dir} -> {args.out} (checkpoint {step}); use it as a run: looplm eval / "
                     f"generate / export {args.out}; fine-tune with train.init_from={args.out}\n")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from looplm.config import parse_overrides
    from looplm.hf.convert import MAP_FILE, TRAIN_FILE, convert_checkpoint

    overrides = parse_overrides(args.overrides)
    if args.lora_rank:  # the Relaxed Recursive Transformer: per-iteration adapters from the residuals' SVD
        overrides = [*overrides, ("model.lora.rank", args.lora_rank)]
    mapping = convert_checkpoint(args.hf_dir, args.out, args.layout, args.init, overrides)
    sys.stdout.write(f"converted {args.hf_dir} -> {args.out} ({mapping.init}, {mapping.layout}); layer map in "
                     f"{args.out}/{MAP_FILE}; up-train with: looplm train {args.out}/{TRAIN_FILE} data.tokenizer=SPEC\n")
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from looplm.distill import load_distill_config, run_distill

    source, overrides = _split_config_and_overrides([*args.items, *args.overrides])
    cfg = load_distill_config(args.teacher, source, tuple(overrides))
    run_distill(args.teacher, cfg, args.stage, resume=args.resume, progress=not args.no_progress)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from looplm.info import describe_source, format_description

    source, overrides = _split_config_and_overrides(args.items)
    info = describe_source(source, overrides, verify=not args.no_verify)  # a config, or a run (with its grown structure)
    sys.stdout.write((json.dumps(info, indent=2) if args.json else format_description(info)) + "\n")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from looplm.probes import PROBES, ProbeError, run_probes

    if args.list:
        for probe in PROBES.values():
            sys.stdout.write(f"{probe.name:<24} {probe.source}\n")
        return 0
    if args.run is None:
        raise ProbeError("RUN_OR_CHECKPOINT is required (or --list)")
    results = run_probes(
        args.run, args.probe or ["all"], data=args.data, samples=args.samples, batch_size=args.batch_size,
        out_dir=args.out, figures=not args.no_figures, verify=not args.no_verify,
    )
    if not results:
        raise ProbeError("no probe applies to this model")
    return 0


def cmd_flops(args: argparse.Namespace) -> int:
    from looplm.accounting import count_flops, match_layouts
    from looplm.accounting.report import format_flops, format_matches
    from looplm.config import load_config

    source, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(source, overrides).model
    seq_len = args.seq_len or cfg.max_seq_len
    report = count_flops(cfg, seq_len, batch=args.batch, convention=args.convention)
    result = report.to_dict()
    target_name = args.match_flops or args.match_params
    matches = None
    if target_name is not None:
        target = load_config(target_name).model if not _is_number(target_name) else float(target_name)
        by = "flops" if args.match_flops else "params"
        matches = match_layouts(cfg, target, by=by, seq_len=seq_len, convention=args.convention)
        result["matches"] = {"by": by, "target": target_name,
                             "layouts": [dataclasses.asdict(m) for m in matches]}
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        sys.stdout.write(format_flops(report) + "\n")
        if matches is not None:
            sys.stdout.write(format_matches(matches, result["matches"]["by"], target_name) + "\n")
    return 0


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def cmd_ladder(args: argparse.Namespace) -> int:
    import shlex

    from looplm.study import run_ladder
    from looplm.study import results_table

    out = args.out or f"runs/ladder-{args.task}-C{args.budget}{'-quick' if args.quick else ''}"
    # `--rungs dense tied k=v`: argparse hands k=v to --rungs; no rung name has an "="
    rungs = [r for r in args.rungs if "=" not in r]
    overrides = [*args.overrides, *(r for r in args.rungs if "=" in r)]
    # Started as `looplm ladder …`: results.md records the command as typed; called as
    # main([...]) from Python, run_ladder spells out the equivalent command instead.
    command = shlex.join(["looplm", *sys.argv[1:]]) if sys.argv[1:2] == ["ladder"] else None
    result = run_ladder(
        args.task, args.budget, out, rungs=rungs, quick=args.quick, steps=args.steps, seed=args.seed,
        outer=args.outer, inner=args.inner, overrides=overrides, command=command, progress=not args.no_progress,
        threads=args.threads,
    )
    sys.stdout.write(results_table(result) + f"\n\nresults: {result.out_dir}/results.md\n")
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    import shlex

    from looplm.study import results_table, run_study

    size = "quick" if args.quick else "paper" if args.paper else args.size or "default"
    command = shlex.join(["looplm", *sys.argv[1:]]) if sys.argv[1:2] == ["study"] else None
    result = run_study(args.name, args.out, size=size, seeds=args.seeds, overrides=args.overrides,
                       threads=args.threads, command=command, progress=not args.no_progress,
                       variants=args.variants.split(",") if args.variants else None)
    sys.stdout.write(results_table(result) + f"\n\nresults: {result.out_dir}/results.md\n")
    return 0


def cmd_claims(args: argparse.Namespace) -> int:
    from pathlib import Path

    from looplm.artifacts import write_text
    from looplm.study.claims import claims_markdown, replace_block

    table = claims_markdown(args.results)
    if args.write is None:
        sys.stdout.write(table + "\n")
        return 0
    path = Path(args.write)
    write_text(path, replace_block(path.read_text(encoding="utf-8"), table), atomic=True)
    log.info("wrote the claims table into %s", path)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from looplm.config import load_config

    source, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(source, overrides)  # validated: what `looplm train` with the same arguments would run
    sys.stdout.write(f"# looplm config {' '.join(args.items) or '(the default main job)'}: every field, resolved\n")
    sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None))
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from looplm.config import preset_names, read_config_source

    for name in preset_names():
        model = read_config_source(name).get("model", {})
        sys.stdout.write(f"{name:<42} layout={model.get('layout')} topology={model.get('topology', {}).get('kind')}\n")
    return 0


def _number(kind: Callable, allowed: str, ok: Callable) -> Callable[[str], object]:
    """An argparse type: ``kind(text)`` satisfying ``ok``, else argparse's one-line usage error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: {allowed}")
        return value

    parse.__name__ = kind.__name__
    return parse


_POSITIVE = _number(int, "an integer >= 1", lambda v: v >= 1)
_COUNT = _number(int, "an integer >= 0", lambda v: v >= 0)
_TEMPERATURE = _number(float, "a number >= 0 (0 is greedy)", lambda v: math.isfinite(v) and v >= 0)
_TOP_P = _number(float, "a number in (0, 1]", lambda v: 0 < v <= 1)
_NO_VERIFY = "load even if the files do not match their manifest (inspecting a damaged checkpoint)"


class _Parser(argparse.ArgumentParser):
    """argparse, with a wrong argument reported as one ``error:`` line (exit 2) like every
    other expected failure, instead of the usage block."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _exit_spec(text: str):
    """``--exit CRITERION:THRESHOLD`` (checked by the halting rule's config)."""
    from looplm.eval.adaptive_exit import ExitSpec

    try:
        return ExitSpec.parse(text)
    except ValueError as error:  # a ConfigError naming the field, value and what is allowed
        raise argparse.ArgumentTypeError(str(error)) from None


def _loop_options(p: argparse.ArgumentParser) -> None:
    """Test-time compute options of every command that runs a trained model."""
    p.add_argument("--iterations", type=_POSITIVE, default=None, metavar="T", help="loop iterations at inference")
    p.add_argument("--no-step-embeddings", action="store_true",
                   help="run without the step embeddings (needed for more iterations than trained)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="looplm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.set_defaults(trailing_overrides=False)

    p = sub.add_parser("train", help="train a model (no CONFIG: the default main job)")
    p.add_argument("items", nargs="*", metavar="[CONFIG] [key=value]")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="PATH",
                   help="continue from train.out_dir's latest checkpoint, or from PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    from looplm.data.tokenize_shards import SHARD_CHARS

    p = sub.add_parser("tokenize", help="tokenize a text source into memory-mapped token shards (data.source=shards:DIR)",
                       description="Tokenize SOURCE (anything data.source accepts: a .txt/.jsonl/.parquet file or "
                       "folder, pydoc, python-stdlib, hf:NAME) into token shards in OUT, across --num-proc processes. An interrupted "
                       "run resumes (complete shards are verified and kept); re-running a finished job is a no-op. "
                       "The held-out split is chosen at training time (data.val_fraction): shards keep every document.")
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--tokenizer", default="byte", metavar="SPEC",
                   help="byte, bpe:N (a BPE trained on SOURCE's training split, cached), a tokenizer.json file or a "
                   "transformers directory (default byte)")
    p.add_argument("--num-proc", type=_POSITIVE, default=1, metavar="N", help="tokenizing processes (default 1)")
    p.add_argument("--text-field", default="text", metavar="F", help="text column of jsonl/parquet/datasets")
    p.add_argument("--hf-config", default=None, metavar="NAME", help="configuration of an hf: dataset")
    p.add_argument("--hf-split", default="train", metavar="SPLIT", help="split of an hf: dataset (default train)")
    p.add_argument("--streaming", action="store_true",
                   help="stream an hf: dataset instead of downloading it whole first (same documents, same order)")
    p.add_argument("--shard-chars", type=_POSITIVE, default=SHARD_CHARS, metavar="C",
                   help=f"characters of text per shard (default {SHARD_CHARS})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("eval", help="validation loss and perplexity of a run or checkpoint")
    p.add_argument("run", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("overrides", nargs="*", metavar="data.key=value", help="evaluate on other data")
    p.add_argument("--batches", type=_POSITIVE, default=None, help="number of validation batches")
    p.add_argument("--corpus", action="append", default=[], metavar="NAME=PATH",
                   help="score every document of a corpus (repeatable): token perplexity, bits per byte, word "
                   "perplexity; PATH is anything data.source accepts")
    p.add_argument("--window", type=_POSITIVE, default=None,
                   help="with --corpus: input tokens per forward (default model.max_seq_len)")
    p.add_argument("--stride", type=_POSITIVE, default=None,
                   help="with --corpus: sliding-window step, <= window (default window: disjoint windows)")
    p.add_argument("--batch-size", type=_POSITIVE, default=8, help="sequences per forward (default 8)")
    _loop_options(p)
    p.add_argument("--exit", action="append", default=[], type=_exit_spec, metavar="CRITERION:THRESHOLD",
                   help="also evaluate with a zero-shot adaptive exit (repeatable): kl:5e-4 (Huginn's KL between "
                   "successive steps) or entropy:NATS; prints its loss paid and compute saved against the full loop")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks on a run (needs the eval extra)",
                       description="Evaluate a run on lm-evaluation-harness tasks (lm-eval's own task names, or "
                       "task YAML files in --include-path) and print lm-eval's results table; or run a paper's "
                       "downstream suite (--suite) and write its table in the paper's layout.")
    p.add_argument("run", metavar="RUN_OR_CHECKPOINT")
    from looplm.eval.suites import SUITES

    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tasks", nargs="+", metavar="TASK", help="task or group names")
    which.add_argument("--suite", choices=list(SUITES),
                       help="a paper's task list, shots and metrics; writes its table (markdown + JSON) to --output")
    p.add_argument("--num-fewshot", type=_COUNT, default=None, metavar="N",
                   help="few-shot examples (default: the task's)")
    p.add_argument("--batch-size", type=_POSITIVE, default=1, metavar="B", help="sequences per forward (default 1)")
    _loop_options(p)
    p.add_argument("--limit", type=_POSITIVE, default=None, metavar="N", help="at most N examples per task")
    p.add_argument("--include-path", default=None, metavar="DIR", help="a directory of extra task YAML files")
    p.add_argument("--max-length", type=_POSITIVE, default=None, metavar="L",
                   help="context in tokens (default model.max_seq_len)")
    p.add_argument("--seed", type=int, default=0, help="few-shot sampling and every random seed lm-eval sets")
    p.add_argument("--output", default=None, metavar="PATH",
                   help="also write the results (and samples) as JSON; with --suite: the table's JSON, markdown "
                   "beside it (default RUN/lm-eval/SUITE.json)")
    p.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    p.set_defaults(func=cmd_lm_eval)

    from looplm.eval.niah import DEFAULT_DEPTHS, DEFAULT_LENGTHS, TASKS as NIAH_TASKS

    p = sub.add_parser("niah", help="RULER needle-in-a-haystack (single 1/2/3) at several lengths and depths",
                       description="Generate RULER's NIAH-single-1/2/3 examples locally (LT2's long-context "
                       "protocol), answer them greedily with the run's model and score the value by exact match; "
                       "writes niah.md, niah.json and niah.png into --out.")
    p.add_argument("run", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("--lengths", nargs="+", type=_POSITIVE, default=list(DEFAULT_LENGTHS), metavar="N",
                   help="tokens per example, prompt + answer (default 1024 2048 4096; at most model.max_seq_len)")
    p.add_argument("--depths", nargs="+", type=int, default=list(DEFAULT_DEPTHS), metavar="PCT",
                   help="needle depths in percent of the haystack (default 0 25 50 75 100)")
    p.add_argument("--samples", type=_POSITIVE, default=10, help="examples per task, length and depth (default 10)")
    p.add_argument("--tasks", nargs="+", choices=list(NIAH_TASKS), default=list(NIAH_TASKS), metavar="TASK",
                   help="default all: " + " ".join(NIAH_TASKS))
    p.add_argument("--haystack", default="essay:pydoc", metavar="repeat|essay:PATH",
                   help="the essay tasks' corpus (anything data.source accepts; default essay:pydoc), or repeat: "
                   "the repeated noise for every task")
    p.add_argument("--batch-size", type=_POSITIVE, default=1, metavar="B", help="examples decoded together")
    _loop_options(p)
    p.add_argument("--seed", type=int, default=0, help="keys, values and haystack offsets")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default RUN/niah)")
    p.add_argument("--no-figures", action="store_true", help="no heat-map (no matplotlib needed)")
    p.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    p.set_defaults(func=cmd_niah)

    p = sub.add_parser("generate", help="sample text from a run or checkpoint")
    p.add_argument("run", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=_COUNT, default=200)
    p.add_argument("--temperature", type=_TEMPERATURE, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-k", type=_POSITIVE, default=None)
    p.add_argument("--top-p", type=_TOP_P, default=None)
    _loop_options(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", nargs="?", const=True, default=False, choices=["cuda-graph"],
                   help="decode through one captured step over a static cache (torch.compile; CUDA graphs on a "
                        "GPU); --compile cuda-graph records the eager step as CUDA graphs instead (no torch.compile)")
    p.add_argument("--exit", type=_exit_spec, default=None, metavar="CRITERION:THRESHOLD",
                   help="decode with a zero-shot adaptive exit (kl:5e-4, entropy:NATS); logs the block passes per token")
    p.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("export", help="write a transformers directory (Auto* classes, generate()); needs the hf extra")
    p.add_argument("run", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--iterations", type=_POSITIVE, default=None,
                   help="loop count the exported model runs at (config field iterations; default the trained count)")
    p.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="byte, a tokenizer.json or a transformers tokenizer directory (default: the run's data.tokenizer)")
    p.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="a run directory from an Ouro, GPT-NeoX or LLaMA checkpoint (its weights and "
                       "tokenizer), for eval / generate / export")
    p.add_argument("hf_dir", metavar="HF_DIR")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="byte, a tokenizer.json or a transformers tokenizer directory "
                        "(default: HF_DIR's tokenizer files)")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("convert", help="a looped model from a dense GPT-NeoX / LLaMA checkpoint (Relaxed Recursive "
                       "Transformers init; see looplm.hf.convert for the layer maps)")
    p.add_argument("hf_dir", metavar="HF_DIR")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--layout", required=True, metavar="P+CRT+Q", help="looped layout, e.g. 4+8R2+4")
    p.add_argument("--init", required=True, metavar="{average,select,stepwise}",
                   help="average the tied layers, take every k-th (stepwise) or the first core-many (select)")
    p.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="per-iteration LoRA of rank R on the core's linears, from the truncated SVD of each "
                        "dense layer's residual to its tied weight (Relaxed Recursive Transformers; 0: none)")
    p.add_argument("overrides", nargs="*", metavar="model.key=value", help="e.g. model.topology.kind=anchor")
    p.set_defaults(func=cmd_convert, trailing_overrides=True)

    p = sub.add_parser("distill", help="distil a looped transformer into a linear-time hybrid (LT2 §5): stage 1 "
                       "alignment, layer selection, stage 2 per-loop KD, stage 3 continuation")
    p.add_argument("teacher", metavar="TEACHER", help="a looplm run or checkpoint, or a Hugging Face checkpoint looplm imports")
    p.add_argument("items", nargs="*", metavar="[STUDENT_CONFIG] [key=value]")
    p.add_argument("--stage", default="all", choices=["1", "select", "2", "3", "all"],
                   help="run one stage (default: all, in order)")
    p.add_argument("--resume", action="store_true", help="continue each stage from its latest checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_distill, overrides=[], trailing_overrides=True)  # key=value after --stage too

    p = sub.add_parser("info", help="layout, unrolled depth and parameter counts of a config")
    p.add_argument("items", nargs="+", metavar="CONFIG [key=value]")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("probe", help="analysis probes (MeSH, SpiralFormer, SGT, LT2, logit lens) on a run")
    p.add_argument("run", nargs="?", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("--probe", action="append", metavar="NAME", help="probe name, repeatable; default: all (--list)")
    p.add_argument("--data", nargs="*", default=[], metavar="key=value",
                   help="data fields to override (data. prefix optional; a bare PATH sets the source)")
    p.add_argument("--samples", type=_POSITIVE, default=64, help="held-out sequences to probe (default 64)")
    p.add_argument("--batch-size", type=_POSITIVE, default=8)
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default RUN/probes)")
    p.add_argument("--no-figures", action="store_true", help="write the JSON numbers only (no matplotlib needed)")
    p.add_argument("--list", action="store_true", help="list the probes and the figures they reproduce")
    p.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("flops", help="FLOPs per sequence and per token, per component, under a convention")
    p.add_argument("items", nargs="+", metavar="CONFIG [key=value]")
    p.add_argument("--seq-len", type=_POSITIVE, default=None, help="tokens per sequence (default model.max_seq_len)")
    p.add_argument("--batch", type=_POSITIVE, default=1)
    p.add_argument("--convention", default="default",
                   help="default, mesh, spiralformer, sgt, lt2 or torch (docs/accounting.md)")
    match = p.add_mutually_exclusive_group()
    match.add_argument("--match-flops", metavar="TARGET",
                       help="layouts of this block with the FLOPs of TARGET (a preset/YAML or a number)")
    match.add_argument("--match-params", metavar="TARGET",
                       help="layouts of this block with the parameters of TARGET (a preset/YAML or a number)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_flops)

    from looplm.ladder.rungs import RUNGS
    from looplm.tasks.config import CHARACTER_TASKS

    p = sub.add_parser("ladder", help="train the compute-placement ladder on a character task and tabulate it",
                       description="Train each rung of the compute-placement ladder (the autoregressive TRM "
                       "paper's Table 1: dense, tied, tied+step, UT+ACT, two-stream, nested two-stream, AR-TRM) at "
                       "the same block-pass budget from the preset task-TASK, then write results.md, "
                       "results.csv and plots into --out. Rerunning the same command reuses finished rungs and "
                       "resumes an interrupted one.")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="fields shared by every rung, e.g. train.lr=1e-3")
    p.add_argument("--task", required=True, choices=CHARACTER_TASKS)
    p.add_argument("--budget", type=int, required=True, metavar="C", help="block passes per forward, e.g. 12")
    p.add_argument("--quick", action="store_true",
                   help="a small size: all seven rungs in under 20 minutes on 2 CPU cores")
    p.add_argument("--rungs", nargs="+", default=list(RUNGS), metavar="RUNG",
                   help="rungs to train, default all: " + " ".join(RUNGS))
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default runs/ladder-TASK-CBUDGET, with -quick for --quick)")
    p.add_argument("--steps", type=_POSITIVE, default=None, help="training steps per rung (train.max_steps)")
    p.add_argument("--seed", type=int, default=0, help="model init, training stream and evaluation problems")
    p.add_argument("--outer", type=int, default=1, metavar="H", help="outer cycles of the nested rungs (default 1)")
    p.add_argument("--inner", type=int, default=2, metavar="L", help="inner refinements of the nested rungs (default 2)")
    p.add_argument("--threads", type=_POSITIVE, default=None, metavar="N", help="torch threads (torch.set_num_threads)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_ladder)

    from looplm.study.studies import study_names

    p = sub.add_parser("study", help="train a study (a paper's comparison) over seeds and tabulate it",
                       description="Train every configuration of a study at every seed on the same data and "
                       "budget, then write results.md (mean ± std over seeds, the paper's numbers beside), "
                       "results.csv, runs.csv, series.csv (the curves) and plots into --out. Rerunning the same "
                       "command reuses finished runs and resumes an interrupted one. Studies: " + ", ".join(study_names()) + ".")
    p.add_argument("name", metavar="NAME", help="the study: " + ", ".join(study_names()))
    p.add_argument("overrides", nargs="*", metavar="key=value", help="fields shared by every run, e.g. train.device=cuda")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a seconds-scale smoke version (2 seeds)")
    size.add_argument("--paper", action="store_true", help="the paper's size (GPUs; see README 'Reproductions')")
    size.add_argument("--size", default=None, metavar="NAME",
                      help="a size by name: default, quick, paper, or stdlib (the unrepeated standard-library "
                           "corpus: a learning-rate sweep, then 3 paired seeds, up to 5 for the rows still undecided); the "
                           "ladder's bias-sweep (every ACT rung at starting bias 1, -1, -3) and bias-sweep-quick")
    p.add_argument("--seeds", type=int, default=None, metavar="N", help="seeds 0 … N-1 (default: the size's, 3)")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default runs/study-NAME[-quick|-paper])")
    p.add_argument("--threads", type=_POSITIVE, default=None, metavar="N", help="torch threads (torch.set_num_threads)")
    p.add_argument("--variants", default=None, metavar="A,B,…",
                   help="train and tabulate only these variants (comma-separated; default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_study, trailing_overrides=True)

    p = sub.add_parser("claims", help="the papers' claims and their verdicts from the committed study tables",
                       description="One row per claim the studies test (looplm.study.claims.CLAIMS): reproduced, "
                       "reversed, not settled (under two standard deviations of the seed-paired differences), "
                       "untested at this scale, or not run yet, with the numbers and seed counts behind the word, "
                       "read from DIR/<study>/runs.csv.")
    p.add_argument("--results", default="docs/results", metavar="DIR", help="the study tables (default docs/results)")
    p.add_argument("--write", default=None, metavar="FILE",
                   help="replace the table between the claims markers in FILE (e.g. README.md) instead of printing")
    p.set_defaults(func=cmd_claims)

    p = sub.add_parser("config", help="print the full resolved config of a preset or YAML (every field)")
    p.add_argument("items", nargs="*", metavar="[CONFIG] [key=value]")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("presets", help="list the shipped presets")
    p.set_defaults(func=cmd_presets)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    # argparse binds a trailing nargs='*' positional with the ones before the options, so the
    # key=value overrides after `convert HF_DIR OUT --layout L --init I` come back as extras.
    args, extra = parser.parse_known_args(argv)
    if extra and not (args.trailing_overrides and all("=" in e and not e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `looplm presets | head`
        return 0
    except LoopLMError as err:  # config, data, checkpoint, argument, divergence: the message says what to change
        log.error("error: %s", err.for_cli())
        return 2
    except OSError as err:  # a path that does not exist or cannot be written
        log.error("error: %s", f"{err.strerror}: {err.filename}" if err.strerror and err.filename else err)
        return 2
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
