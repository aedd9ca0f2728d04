"""The benchmark scripts run and write their tables (tiny sizes: a smoke test of the
scripts, not a measurement; the figures live in benchmarks/results/)."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from looplm import LoopLM

ROOT = Path(__file__).resolve().parent.parent
#: whether generate() has the captured decode step (``compile=True``); its rows are skipped before
HAS_COMPILED_GENERATE = "compile" in inspect.signature(LoopLM.generate).parameters


def run(script: str, *args: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def benchmark(name: str):
    """The module of benchmarks/NAME.py (run in process: the path CUDA runs take)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_mixer_benchmark_writes_its_table(tmp_path):
    out = tmp_path / "mixers.md"
    run("mixers.py", "--kinds", "attention", "gated_deltanet", "--lengths", "64", "--heads", "2",
        "--head-dim", "16", "--repeats", "1", "--threads", "1", "--out", str(out))
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| attention", "| gated_deltanet"))]
    assert len(rows) == 4, text  # training and decode rows of both kinds
    assert "error" not in text, text
    assert "Backend: looplm's PyTorch ops" in text
    pytest.importorskip("fla")
    assert "naive_chunk_gated_delta_rule" in text and "| 64 |" in text


def test_mixer_benchmark_in_process_path():
    """The path CUDA runs take (no subprocess per job), exercised on CPU."""
    mixers = benchmark("mixers")
    job = dict(what="train", kind="gla", backend="torch", length=32, heads=2, head_dim=16, device="cpu",
               repeats=1, batch=2, dtype="bfloat16")
    result = mixers._measure(dict(job))
    assert result.get("seconds", 0) > 0, result
    decode = {k: v for k, v in job.items() if k != "length"} | {"what": "decode", "context": 32}
    result = mixers._measure(decode)
    assert result.get("seconds", 0) > 0, result


def test_sgt_benchmark_writes_its_table(tmp_path):
    out = tmp_path / "sgt.md"
    run("sgt.py", "--d-model", "32", "--heads", "4", "--layers", "3", "--vocab", "64", "--seq-len", "16",
        "--batch", "2", "--steps", "1", "--warmup", "0", "--max-depth", "2", "--threads", "1", "--out", str(out))
    text = out.read_text()
    assert all(name in text for name in ("vanilla", "block-loop", "sgt-k1", "sgt-k2")), text


def test_long_context_benchmark_writes_its_tables(tmp_path):
    out = tmp_path / "long.md"
    run("long_context.py", "--models", "looped transformer", "GDN+DSA hybrid", "--contexts", "32", "64",
        "--d-model", "32", "--heads", "2", "--new", "2", "--threads", "1", "--out", str(out))
    text = out.read_text()
    assert text.count("| looped transformer |") == 4 and text.count("| GDN+DSA hybrid |") == 4, text
    assert "error" not in text and "OOM" not in text, text
    assert "Decode throughput against the looped transformer at S=64" in text
    assert "Precision fp32" in text and "warm-up: one untimed prefill and 3 decode steps" in text, text


def count_prefills(model, context: int) -> list[int]:
    """A list that grows by one at every forward of ``model`` over ``context`` new positions."""
    calls: list[int] = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1) if args[0].shape[1] == context else None)
    return calls


@pytest.mark.parametrize("decode_via, prefills", [("cache", 2), ("generate", 2 + 2 * 3)])  # generate: 3 repeats
def test_long_context_in_process_cells_warm_up_and_share_one_model(decode_via, prefills):
    """The CUDA path, on CPU: one bf16 model serves every context of a run, and each cell
    runs untimed what it times first (a prefill; with generate both calls)."""
    lc = benchmark("long_context")
    # 6 new tokens: their decode time stands clear of the timer's noise on a loaded machine
    args = lc.parse(["--models", "GDN+DSA hybrid", "--contexts", "16", "32", "--d-model", "32", "--heads", "2",
                     "--new", "6", "--dtype", "bf16", "--decode-via", decode_via, "--threads", "1",
                     "--repeats", "3"])
    job = {"model": "GDN+DSA hybrid", **lc.job_options(args)}
    model = lc.build(job, lc.max_len_for(32, 6))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # cast, not autocast
    for context in (16, 32):
        calls = count_prefills(model, context)
        result = lc.measure({**job, "context": context}, model)
        assert result.get("prefill_tok_s", 0) > 0 and result.get("decode_tok_s", 0) > 0 and "error" not in result, result
        assert len(calls) == prefills


@pytest.mark.skipif(not HAS_COMPILED_GENERATE, reason="generate() has no compile parameter yet")
@pytest.mark.parametrize("how", [["--compile"], ["--compile", "cuda-graph"]])
def test_long_context_compiled_cell_decodes_through_generate(how):
    lc = benchmark("long_context")
    args = lc.parse(["--models", "looped transformer", "--contexts", "16", "--d-model", "32", "--heads", "2",
                     "--new", "6", *how, "--threads", "1", "--repeats", "3"])
    assert args.decode_via == "generate" and args.compile == (how[1] if len(how) > 1 else True)
    assert lc.default_out(args).name == f"long-context-{'cuda-graph' if len(how) > 1 else 'compiled'}-cpu.md"
    job = {"model": "looped transformer", "context": 16, **lc.job_options(args)}
    try:
        result = lc.measure(job)
    finally:
        torch._dynamo.reset()
    assert result.get("prefill_tok_s", 0) > 0 and result.get("decode_tok_s", 0) > 0, result


def test_long_context_refuses_inconsistent_options():
    lc = benchmark("long_context")
    refused = [["--shape", "lt2-0.6b", "--d-model", "64"], ["--compile", "--decode-via", "cache"],
               ["--profile", "looped GDN", "--decode-via", "generate"], ["--contexts", "64", "32"]]
    if not HAS_COMPILED_GENERATE:
        refused.append(["--compile"])
    for argv in refused:
        with pytest.raises(SystemExit):
            lc.parse(argv)
    assert lc.parse(["--device", "cuda"]).dtype == "bf16" and lc.parse([]).dtype == "fp32"


def test_long_context_lt2_shape_is_the_papers_four_models():
    """--shape lt2-0.6b: lt2.txt Table 2's looped 0.6B models, max_seq_len covering the run."""
    lc = benchmark("long_context")
    expected = {"looped transformer": ("25R4", "attention", None), "looped GDN": ("25R4", "gated_deltanet", None),
                "Full+GDN hybrid": ("21R4", "gated_deltanet", "attention"),
                "GDN+DSA hybrid": ("21R4", "dsa", "gated_deltanet")}
    for name, (layout, mixer, periodic) in expected.items():
        cfg = lc.model_config("lt2-0.6b", name, 8192 + 30)
        assert (cfg.d_model, cfg.n_heads, cfg.layout, cfg.mixer.kind) == (1024, 16, layout, mixer), name
        assert (cfg.hybrid.mixer.kind if cfg.hybrid else None) == periodic, name
        assert cfg.vocab_size == 128256 and cfg.max_seq_len == 8192 + 30
    args = lc.parse(["--shape", "lt2-0.6b", "--contexts", "2048", "8192", "--compile", "--decode-via", "generate"]
                    if HAS_COMPILED_GENERATE else ["--shape", "lt2-0.6b", "--contexts", "2048", "8192"])
    assert re.search(r"looped transformer `lt2-0.6b-transformer` 25R4, [0-9.]+M parameters", lc.shape_line(args))
    assert lc.default_out(args).name == ("long-context-lt2-0.6b-compiled-cpu.md" if HAS_COMPILED_GENERATE
                                         else "long-context-lt2-0.6b-cpu.md")


def test_long_context_report_of_a_stopped_run_marks_what_is_missing():
    lc = benchmark("long_context")
    args = lc.parse(["--contexts", "16", "32", "--models", "looped transformer", "looped GDN"])
    done = {"prefill_tok_s": 100.0, "decode_tok_s": 10.0, "peak_mib": 1.0}
    text = lc.render(args, {("looped transformer", 16): done, ("looped transformer", 32): done,
                            ("looped GDN", 16): {"error": "RuntimeError: boom"}}, ["# header", ""])
    assert "**Partial**: 1 of 4 cells not measured" in text
    assert "| looped GDN | error | … |" in text and "- looped GDN, S=16: RuntimeError: boom" in text
    assert "| looped transformer | 1.00x | 1.00 |" in text and "| looped GDN | - | - |" in text


#: a tiny generate.py run: 2 layers, d 64, batches 1 and 2, 4 new tokens
GENERATE_TINY = ["--device", "cpu", "--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "256",
                 "--prompt-len", "8", "--new-tokens", "4", "--warmup", "1", "--repeats", "1", "--threads", "1"]


def run_generate(argv: list[str]) -> list[dict]:
    threads = torch.get_num_threads()
    try:
        return benchmark("generate").main(argv)
    finally:
        torch.set_num_threads(threads)


def test_generate_benchmark_eager_rows(tmp_path):
    out = tmp_path / "generate.md"
    rows = run_generate([*GENERATE_TINY, "--batches", "1", "2", "--systems", "looplm eager", "transformers eager",
                         "--out", str(out)])
    assert [(r["batch"], r["system"]) for r in rows] == [
        (1, "transformers eager"), (1, "looplm eager"), (2, "transformers eager"), (2, "looplm eager")]
    for row in rows:  # fp32, the same weights: the same greedy tokens
        assert row["seconds"] > 0 and row["same_tokens"] == row["batch"] * 4, row
    text = out.read_text()
    assert float(re.search(r"logit difference\| on the prompt: fp32 (\S+) ", text)[1]) <= 1e-5, text
    assert "torch " in text and "transformers " in text and "Card: CPU" in text
    assert len(re.findall(r"^\| [12] \| (looplm|transformers) eager \| [0-9.]+ \|", text, re.M)) == 4, text


def test_generate_benchmark_compiled_rows():
    """transformers' static cache + compile always; looplm's compile=True where generate has it."""
    try:
        rows = run_generate([*GENERATE_TINY, "--batches", "1"])
    finally:
        torch._dynamo.reset()
    by = {r["system"]: r for r in rows}
    assert by["transformers static + compile"]["compiled"] is True
    compiled = ["transformers static + compile"]
    if HAS_COMPILED_GENERATE:
        compiled += ["looplm compiled", "looplm CUDA graph"]
    else:
        assert "no compile parameter" in by["looplm compiled"]["skipped"]
    for system in compiled:
        assert by[system]["seconds"] > 0 and by[system]["same_tokens"] == 4, by[system]


def test_generate_benchmark_refuses_models_that_differ():
    gen = benchmark("generate")
    model, hf = gen.llama_pair(gen.parse(GENERATE_TINY), torch.device("cpu"))
    ids = torch.randint(0, 256, (1, 8))
    assert "fp32" in gen.check_same_logits(model, hf, ids)
    with torch.no_grad():
        model.norm.weight.mul_(1.05)
    with pytest.raises(SystemExit, match="disagree"):
        gen.check_same_logits(model, hf, ids)


def test_gpu_script_is_valid_bash_and_calls_what_exists():
    """benchmarks/gpu.sh: valid syntax; its parts fit 8 minutes; every script and test folder
    it names exists (a single test named by its node id too), and each benchmark's argument parser accepts the arguments given."""
    script = ROOT / "benchmarks" / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    done = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    parts = re.findall(r"^PART (.+?) (\d+)s: (.+)$", done.stdout, re.M)
    names = [name for name, _, _ in parts]
    assert names[0] == "GPU tests" and "generate" in names and "train throughput" in names, names
    assert sum(int(limit) for _, limit, _ in parts) <= 480
    for name, _, command in parts:
        words = shlex.split(command)
        paths = [w for w in words if w.startswith(("benchmarks/", "tests/")) and not w.endswith(".md")]
        files = [p.split("::") for p in paths]  # a test file, or one test of it (file::name)
        assert paths and all((ROOT / f[0]).exists() for f in files), (name, paths)
        assert all(f"def {f[1]}(" in (ROOT / f[0]).read_text() for f in files if len(f) > 1), (name, paths)
        if words[1].endswith(".py"):
            module, argv = benchmark(Path(words[1]).stem), words[2:]
            if "--compile" in argv and words[1].endswith("long_context.py") and not HAS_COMPILED_GENERATE:
                with pytest.raises(SystemExit):
                    module.parse(argv)
            else:
                module.parse(argv)
    shapes = {w for _, _, c in parts for w in re.findall(r"--shape (\S+)", c)}
    assert shapes == {"lt2-0.6b"}  # the paper's shape, where issue 30's 5.7x target is set
    assert any("--compile cuda-graph" in c for _, _, c in parts)  # its decode recorded as CUDA graphs


def test_train_throughput_core_reports_consistent_numbers(tmp_path):
    """train_throughput.py's figures follow from its measurements: FLOPs/token is the
    accounting module's, tokens/s and MFU come from the step times, each ratio from the rows."""
    bench = benchmark("train_throughput")
    from looplm.accounting import count_flops

    threads = torch.get_num_threads()
    out = tmp_path / "throughput.md"
    argv = ["--width", "32", "--seq", "32", "--batch", "2", "--steps", "1", "--repeats", "1", "--warmup", "1",
            "--no-compile", "--threads", "1", "--peak-flops", "1e11", "--out", str(out)]
    try:
        result = bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    args = bench.parse(argv)
    rows = {(r.group, r.variant): r for r in result["rows"]}
    assert len(rows) == len(result["rows"]) and not any(r.compiled for r in rows.values())
    # every variant timed, each beside the others of its target's group, dense in each group it serves
    assert sorted(rows) == sorted((group, v) for group, members in bench.GROUPS for v in members)
    assert {v for _, v in rows} == set(bench.VARIANTS)
    for (_, name), row in rows.items():
        plain = count_flops(bench.run_config(name, args, str(tmp_path), False).model, 32).training_per_token
        if name in ("sgt", "block-loop"):  # grown: the counter charges the extra passes
            assert row.flops_per_token > plain
        else:
            assert row.flops_per_token == plain
        assert row.seconds > 0 and row.tokens_per_s == pytest.approx(2 * 32 / row.seconds)
        assert row.mfu == pytest.approx(row.flops_per_token * row.tokens_per_s / 1e11)
    spiral, full = rows[("spiral", "spiral")], rows[("spiral", "spiral-full")]
    sgt, dense_sgt, dense_loop = rows[("sgt", "sgt")], rows[("sgt", "dense")], rows[("loop", "dense")]
    assert spiral.flops_per_token < full.flops_per_token  # the coarse iterations cost less
    ratios = {(q["target"], q["what"].split()[0]): q for q in result["ratios"]}
    base = ratios[("loop efficiency", "base")]  # against the dense timed beside it
    assert base["value"] == pytest.approx(rows[("loop", "base")].flops_per_s / dense_loop.flops_per_s)
    spiral_q = ratios[("SpiralFormer saving", "wall-clock")]
    saving = (1 - spiral.seconds / full.seconds) / (1 - spiral.flops_per_token / full.flops_per_token)
    assert spiral_q["value"] == pytest.approx(saving)
    sgt_q = ratios[("SGT overhead", "step-time")]
    overhead = (sgt.seconds / dense_sgt.seconds - 1) / (sgt.flops_per_token / dense_sgt.flops_per_token - 1)
    assert sgt_q["value"] == pytest.approx(overhead) and sgt_q["passed"] == (overhead <= 2.0)
    text = out.read_text()
    verdicts = [line for line in text.splitlines() if line.endswith(("| PASS |", "| FAIL |"))]
    assert len(verdicts) == 4, text  # base, mesh, SpiralFormer, SGT
    assert "Not timed" not in text
    assert "1.000e+11 FLOP/s (given (--peak-flops))" in text
    assert "GDN trains on: looplm's PyTorch chunk op (no CUDA device" in text
    assert not result["failed"] and "Failed" not in text


def test_train_throughput_reports_a_failing_variant_and_times_the_others(tmp_path, monkeypatch):
    """A variant that fails on the device (its kernels, say) costs the run only its own row:
    the failure is reported, the rest are timed, and the script's exit status says so."""
    bench = benchmark("train_throughput")
    build = bench.build

    def failing(name, *args, **kwargs):
        if name == "mesh":
            raise RuntimeError("PTX compilation failed\nsecond line")
        return build(name, *args, **kwargs)

    monkeypatch.setattr(bench, "build", failing)
    threads = torch.get_num_threads()
    argv = ["--width", "32", "--seq", "16", "--batch", "1", "--steps", "1", "--repeats", "1", "--warmup", "1",
            "--no-compile", "--threads", "1", "--variants", "dense", "mesh", "base", "--out", str(tmp_path / "t.md")]
    try:
        result = bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    assert [(r.group, r.variant) for r in result["rows"]] == [("loop", "dense"), ("loop", "base")]
    assert result["failed"] == {("mesh", False): "RuntimeError: PTX compilation failed"}
    text = (tmp_path / "t.md").read_text()
    assert "**Failed** (not timed): mesh: `RuntimeError: PTX compilation failed`" in text
    assert "| loop | base | no |" in text and "| mesh | no |" not in text


def test_train_throughput_writes_each_group_as_it_ends(tmp_path):
    """A run stopped at its deadline keeps the targets it finished: the report is rewritten
    after each group (the reference timed again beside each), saying which groups are still
    to come; a group that would time the reference alone is not run."""
    bench = benchmark("train_throughput")
    out = tmp_path / "t.md"
    seen = []
    write = bench.publish

    def record(text, path, *args, **kwargs):  # the report as each group leaves it
        if path == str(out):
            seen.append(text)
        return write(text, path, *args, **kwargs)

    argv = ["--width", "32", "--seq", "16", "--batch", "1", "--steps", "1", "--repeats", "1", "--warmup", "1",
            "--no-compile", "--threads", "1", "--variants", "sgt", "dense", "base", "--out", str(out)]
    assert [g for g, _ in bench.groups_of(bench.parse(argv).variants)] == ["loop", "sgt"]
    assert bench.groups_of(["dense"]) == [("loop", ["dense"])]  # not again in the SGT and GDN groups
    threads = torch.get_num_threads()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(bench, "publish", record)
            result = bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    assert [(r.group, r.variant) for r in result["rows"]] == [("loop", "dense"), ("loop", "base"),
                                                            ("sgt", "dense"), ("sgt", "sgt")]
    assert len(seen) == 2  # after each group (the last one's is the whole run's)
    first, last = seen[0], seen[-1]
    assert "**Not timed** (the run stopped before these groups): sgt (eager)." in first
    assert "| loop efficiency | eager |" in first and "SGT overhead" not in first
    assert "Not timed" not in last and "| SGT overhead | eager |" in last and out.read_text() == last
    assert "| loop | dense | no |" in last and "| sgt | dense | no |" in last


def test_train_throughput_reports_the_compiled_dense_mfu():
    """The compiled-MFU target (issue 25: >= 40 % at d = 2048) is read from the compiled dense row."""
    bench = benchmark("train_throughput")
    args = bench.parse(["--width", "2048", "--variants", "dense"])
    rows = [bench.Row("dense", compiled, group, seconds, 8192, 1e9, 1e15, 1.0) for group, compiled, seconds in
            (("loop", False, 0.02), ("loop", True, 0.016), ("sgt", False, 0.021), ("sgt", True, 0.017))]
    groups = [("loop", False), ("sgt", False), ("loop", True), ("sgt", True)]
    result = {"rows": rows, "ratios": bench.ratios(rows), "peak": 1e15, "peak_source": "given", "device": "cuda",
              "profiles": {}, "failed": {}, "groups": groups, "planned": groups}
    text = bench.report(args, result, [], (0.0, 0.0))
    assert "Compiled dense MFU at d = 2048: 51.2 % (issue 25's target: >= 40 % at d = 2048)." in text
    # each variant's speed-up once, from the eager and compiled rows of one group
    assert "Compile speed-up (eager step / compiled step): dense 1.25\n" in text


def test_kernel_launches_agree_with_the_default_under_the_interpreter(tmp_path):
    """benchmarks/kernels.py on CPU (TRITON_INTERPRET=1, tiny sizes): every looplm Triton
    kernel it sweeps runs under each launch it would time on a GPU and gives the default's
    results (other positions per program: other program boundaries, the same rows)."""
    pytest.importorskip("triton")
    out = tmp_path / "kernels.md"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--device", "cpu", "--small",
                           "--dtype", "fp32", "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    sections = out.read_text().split("\n## ")[1:]
    assert len(sections) == 6, out.read_text()  # MeSH and both SpiralFormer ops, forward and backward
    for section in sections:
        rows = [line for line in section.splitlines() if line.startswith("| ") and "=" in line]
        assert len(rows) >= 2 and sum("| yes |" in row for row in rows) == 1, section  # the default and others
        assert "failed" not in section, section
        assert all(float(row.rsplit("|", 2)[1]) <= 1e-5 for row in rows), section


def test_kernel_sweep_reports_a_launch_that_changes_the_results():
    """Not vacuous: a launch whose results differ from the default's shows the difference,
    and one the compiler refuses is a row that says so, not the end of the run."""
    bench = benchmark("kernels")

    class Module:
        @staticmethod
        def _blocks(n):
            return {"BN": 4}

    def op(x):
        launch = Module._blocks(x.numel())
        if launch["BN"] == 3:
            raise RuntimeError("out of resources\nmore")
        return x * launch["BN"] / 4

    kernel = bench.Kernel("stand-in", Module, op, (torch.ones(4),), [{"BN": 4}, {"BN": 2}, {"BN": 3}])
    bench.run_kernel(kernel, lambda fn: 1.0)
    rows = {row["launch"]["BN"]: row for row in kernel.rows}
    assert sorted(rows) == [2, 3, 4] and rows[4]["default"] and rows[4]["diff"] == 0  # the default once
    assert rows[2]["diff"] == 0.5 and rows[2]["gbps"] == pytest.approx(32 / 1e6)
    assert rows[3]["error"] == "RuntimeError: out of resources"


def test_launch_counts_table_names_every_target(tmp_path):
    out = tmp_path / "launches.md"
    run("launches.py", "--out", str(out))
    text = out.read_text()
    for row in ("looped transformer", "GDN+DSA hybrid", "mesh / base", "spiral / spiral-full", "sgt / dense"):
        assert row in text, row
    syncs = re.findall(r"\| (\d+(?:\.\d+)?) \|\n", text.split("## Training")[0])
    assert syncs and all(float(s) == 0 for s in syncs)  # no host sync per decoded token


def test_huginn_memory_benchmark_shows_memory_following_the_window(tmp_path):
    out = tmp_path / "huginn.md"
    text = benchmark("huginn_memory").main(["--d-model", "16", "--heads", "2", "--vocab", "64", "--seq-len", "8",
                                            "--batch", "1", "--window", "2", "--counts", "2", "4", "8",
                                            "--device", "cpu", "--out", str(out)])
    assert out.read_text() == text
    ratios = {(row[1].strip(), row[2].strip()): float(row[4]) for row in
              (line.split("|") for line in text.splitlines() if line.startswith(("| k =", "| full")))}
    assert ratios[("k = 2", "2")] == ratios[("k = 2", "8")] == 1.0  # constant beyond the window
    assert ratios[("full backprop", "8")] > 2.5  # grows with r (fixed costs: embeddings, prelude, coda)


def test_mor_skip_benchmark_compares_equal_losses(tmp_path):
    out = tmp_path / "mor.md"
    text = benchmark("mor_skip").main(["--d-model", "16", "--heads", "2", "--vocab", "64", "--seq-len", "12",
                                       "--batch", "2", "--layout", "1+1R3+1", "--repeats", "1", "--device", "cpu",
                                       "--out", str(out)])
    assert out.read_text() == text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith(("| recursion", "| shared"))]
    assert [r[0].strip() for r in rows] == ["recursion", "shared"]
    for row in rows:
        assert 0.5 < float(row[4]) < 1.0  # top-k at the hierarchical capacity: some positions leave
        assert float(row[5]) < 1e-5  # the same weights give the same loss either way


def test_compile_time_benchmark_measures_both_captures_in_process():
    """benchmarks/compile_time.py's row (Dynamo's eager backend: no C++ compile in a test):
    compiled and eager tokens agree, with block regions and unrolled, and the table shows both."""
    ct = benchmark("compile_time")
    rows = [ct.measure("gdn:1R2", regions, "cpu", "eager", new_tokens=2, repeats=1) for regions in (True, False)]
    assert [r["equal"] for r in rows] == [True, True] and rows[0]["passes"] == 2
    text = ct.table(rows + [dict(row="gdn:25R4", regions=False, error="timed out at 900 s")])
    assert rows[0]["operators"] < rows[1]["operators"], rows
    assert "| gdn | 1R2 | 2 | on |" in text and "| gdn | 1R2 | 2 | off (unrolled) |" in text
    assert "| gdn | 25R4 | | off (unrolled) | | timed out at 900 s |" in text


def test_fla_check_table(tmp_path, monkeypatch):
    """benchmarks/fla_check.py (GPU only) with the device, fla's guard and the check replaced:
    a row per kind and dtype, the verdict by looplm's rule, a failed kernel kept as a row."""
    pytest.importorskip("fla", reason="flash-linear-attention not installed")
    from looplm.ops import backend, fla_hopper

    check = benchmark("fla_check")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(backend, "fla_guard_allows", lambda device: False)
    monkeypatch.setattr(fla_hopper, "use_wide_tiles", lambda: True)

    def errors(op, device, dtype):
        if op.family == "decay" and op.channels:
            raise RuntimeError("PTX miscompiled\nsecond line")
        return {"o": 0.004, "dk": 0.5 if op.channels else 0.012}

    monkeypatch.setattr(fla_hopper, "backward_errors", errors)
    out = tmp_path / "fla.md"
    check.main(["--kinds", "gated_deltanet", "kda", "gla", "--dtypes", "bf16", "fp32", "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["gated_deltanet"] * 2 + ["kda"] * 2 + ["gla"] * 2
    assert "| 0.012 (dk) | fla (checked) |" in rows[0] and "| 0.5 (dk) | PyTorch |" in rows[2]
    assert "error: RuntimeError: PTX miscompiled | PyTorch |" in rows[4]
    assert "refuses its gated backward here" in out.read_text()


def test_fla_check_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        benchmark("fla_check").main([])


def test_ladder_speed_times_each_rung(tmp_path):
    out = tmp_path / "ladder.md"
    rows = benchmark("ladder_speed").main(["--device", "cpu", "--compile", "false", "--warmup", "1", "--steps", "2",
                                           "--rungs", "dense", "dual_nested_ut", "--override", "model.d_model=16",
                                           "model.n_heads=2", "train.batch_size=2", "--out", str(out)])
    assert [r["rung"] for r in rows] == ["dense", "dual_nested_ut"]
    for row in rows:
        assert row["step_s"] > 0 and row["projected_s"] == pytest.approx(5000 * row["step_s"])
    text = out.read_text()
    assert "| dense |" in text and "| dual_nested_ut |" in text and "train.compile=false" in text


def test_cpu_step_benchmark_runs_every_setting_and_compares_the_losses(tmp_path):
    out = tmp_path / "cpu-step.md"
    run("cpu_step.py", "--rows", "depth-pydoc-fixed-T3", "--steps", "1", "--repeats", "1", "--out", str(out))
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| depth-pydoc-fixed-T3 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2048 × 257" and cells[6] == "yes", text  # huge pages: the same loss bit for bit
    assert float(cells[7]) < 1e-5, text  # loss_rows: the same loss to float rounding
    assert "transparent_hugepage" in text and "cpu_step.py --rows depth-pydoc-fixed-T3" in text, text


def test_gqa_decode_benchmark_times_the_three_ways_side_by_side(tmp_path):
    """benchmarks/gqa_decode.py: one row per context, the three ways agree (the copies', SDPA's
    grouped heads' and attend_grouped's values), each ratio from the times beside it."""
    out = tmp_path / "gqa.md"
    text = benchmark("gqa_decode").main(["--contexts", "16", "40", "--batch", "2", "--heads", "4", "--kv-heads", "2",
                                         "--head-dim", "8", "--warmup", "0", "--repeats", "1", "--calls", "1",
                                         "--device", "cpu", "--out", str(out)])
    assert out.read_text() == text
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| 16")
            or line.startswith("| 40")]
    assert [r[0] for r in rows] == ["16", "40"]
    for row in rows:
        copies, gqa, folded = (float(x) for x in row[1:4])
        assert float(row[4]) == pytest.approx(gqa / copies, rel=3e-3, abs=1e-3)
        assert float(row[5]) == pytest.approx(folded / copies, rel=3e-3, abs=1e-3)
        assert float(row[6]) < 1e-5
    with pytest.raises(SystemExit):
        benchmark("gqa_decode").parse(["--heads", "6", "--kv-heads", "4"])
