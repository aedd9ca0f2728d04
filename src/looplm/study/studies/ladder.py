"""Study ``ladder``: the compute-placement ladder (autoregressive-trm.txt Table 1) on addition,
with held-out problems and the halting-bias sweep of its ACT rungs (issue 28)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from looplm.config import RunConfig
from looplm.halting.config import HaltingHeadConfig
from looplm.ladder.rungs import MECHANISMS, RUNGS
from looplm.ladder.runner import QUICK_OVERRIDES, ladder_configs
from looplm.study import measures
from looplm.study.definition import (
    Bars,
    Curve,
    Metric,
    PaperColumn,
    RunSpec,
    Size,
    Study,
    check_overrides,
    run_dir,
    varied_keys,
)


def ladder_study(task: str = "addition", budget: int = 12, *, rungs: Sequence[str] | None = None, outer: int = 1,
                 inner: int = 2, sizes: dict[str, Size] | None = None, name: str = "ladder",
                 deviations: Sequence[str] = ()) -> Study:
    """The compute-placement ladder (autoregressive-trm.txt Table 1, App. B) on ``task`` at
    ``budget`` = C block passes as a study: one run per rung; sizes carry the shared
    overrides (``quick``: the ladder's QUICK_OVERRIDES)."""
    rungs = tuple(RUNGS if rungs is None else rungs)
    ladder_configs(task, budget, Path("."), rungs=rungs, outer=outer, inner=inner)  # refuses bad arguments now
    if sizes is None:
        sizes = {"quick": Size({r: RunSpec(f"task-{task}") for r in rungs}, QUICK_OVERRIDES, seeds=1),
                 "default": Size({r: RunSpec(f"task-{task}") for r in rungs}, (), seeds=1)}

    def build(study: Study, size: str, out_dir: Path, seed: int, overrides: Sequence[str]) -> dict[str, RunConfig]:
        """Each run is its rung (the name before any ``@``) with the run's overrides (the
        bias sweep's starting bias) over the size's."""
        spec = study.size(size)
        check_overrides(overrides, varied_keys(spec))
        configs = {}
        for run, run_spec in spec.runs.items():
            rung = rung_of(run)
            cfg = ladder_configs(task, budget, out_dir, rungs=[rung], seed=seed, outer=outer, inner=inner,
                                 overrides=[*spec.shared, *run_spec.overrides, *overrides])[rung]
            configs[run] = RunConfig.from_dict(_with_out_dir(cfg, run_dir(out_dir, run, seed)))
        return configs

    def describe(variant: str, runs: list) -> dict[str, str]:
        model = runs[0].config.model
        cells = {n: ("✓" if on else "") for n, on in zip(MECHANISM_NAMES, MECHANISMS[rung_of(variant)])}
        bias = f"{model.halting.bias:g}" if isinstance(model.halting, HaltingHeadConfig) else ""
        return {**cells, "C": str(model.block_passes), "halting bias": bias,
                "params": f"{runs[0].parameters['total']:,}"}

    metrics = []
    for a in ALPHAS:
        metrics += [Metric(f"em@{a}", f"α={a} EM", percent=True, better="higher"),
                    Metric(f"char@{a}", f"α={a} char", percent=True, better="higher")]
    metrics += [Metric(f"q{q}", f"Q{q} (α=1)", percent=True) for q in range(1, 5)]
    metrics.append(Metric("last", "last (α=1)", percent=True))
    metrics += [Metric("em_seen", "seen EM (L_train)", percent=True), Metric("char_seen", "seen char", percent=True)]
    metrics.append(Metric("readout_depth", "readout depth (passes)", 2))
    paper = ()
    if task == "addition":
        paper = (PaperColumn("char acc, addition L=10", "autoregressive-trm.txt §5 RQ1, Fig. 3: character accuracy "
                             "on addition at length 10", {"dense": "80", "ut_act": "66", "ar_trm": "12"}),)
    elif task in ("copy", "reverse"):
        paper = (PaperColumn(f"char acc, {task} L=10", "autoregressive-trm.txt §5 RQ1, Fig. 3",
                             {"dense": "100", "ut_act": "100", "ar_trm": "11" if task == "copy" else "10"}),)
    return Study(
        name=name,
        title=f"Compute-placement ladder: {task}, C = {budget} block passes (autoregressive-trm.txt Table 1)",
        paper="autoregressive-trm.txt, Table 1 (the ladder), §5 Fig. 3 (accuracies), Figs. 4-6",
        claim="under matched block passes Dense ≥ UT+ACT on addition (80 % vs 66 % characters), both solve copy "
              "and reverse, the autoregressive TRM stays near chance; two-stream rungs resist late-position collapse",
        sizes=sizes,
        metrics=tuple(metrics),
        measure=measures.ladder_rung,
        paper_columns=paper,
        figures=(
            Curve("accuracy.png", "char", "character accuracy over training (Fig. 6)", "training step",
                  "character accuracy (α=1)", ylim=(-0.02, 1.02)),
            Bars("quartiles.png", ("q1", "q2", "q3", "q4"), ("Q1", "Q2", "Q3", "Q4"),
                 "accuracy by output quartile (Fig. 4)", "character accuracy (α=1)"),
            Curve("length.png", "length", "length generalisation", "α = L_eval / L_train", "character accuracy",
                  ylim=(-0.02, 1.02)),
            Curve("last_char.png", "last", "last character over training (Fig. 5)", "training step",
                  "last-character accuracy (α=1)", ylim=(-0.02, 1.02)),
            Curve("halting_weights.png", "halting_weight", "ACT weight per macro step, held-out answers",
                  "macro step τ", "mean ACT weight w_τ", ylim=(-0.02, 1.02)),
        ),
        deviations=tuple(deviations) + ("ACT and Q-halt in full-compute mode (App. B.1): every rung spends C.",),
        describe=describe,
        notes=_readout_note,
        build=build,
    )


#: Table 1's columns, in the order of the ladder's MECHANISMS tuples.
MECHANISM_NAMES = ("tie", "step", "ACT", "2S", "nest", "Q-halt")
ALPHAS = ("1", "1.5", "2", "3", "5")


def _readout_note(result) -> str:
    """What the readout-depth column measures (results.md), where some run measured it."""
    if not any(result.values(v, "readout_depth") for v in result.variants):
        return ""
    return (f"Readout depth: the block passes behind the readout, on the answer characters of "
            f"{measures.HALTING_SAMPLES} held-out problems after training: under ACT the expected depth "
            "Σ_τ w_τ·τ·(passes per macro step) of its weighted readout, under Q-halt's terminal readout every pass "
            "run (C); blank without a halting rule. The mean ACT weight w_τ (Q-halt: σ(q)) per macro step τ is the "
            "series `halting_weight` (`q_halt`) in series.csv.")


def rung_of(run: str) -> str:
    """The rung a ladder run trains: its name before any ``@`` (``ut_act@bias-3``: ut_act)."""
    return run.split("@", 1)[0]


def _with_out_dir(cfg: RunConfig, path: Path) -> dict:
    data = cfg.to_dict()
    data["train"]["out_dir"] = str(path)
    return data


#: Addition with the carry chain made learnable on a CPU: operands of exactly 2 digits (the
#: authors' generator draws every operand at the fixed length L_train; fewer digits is the
#: deviation). At d = 64 Dense crosses the last-character bottleneck after about 2500 steps at
#: L_train = 2, but not within 4500 at L_train = 3 or 4 (docs/results/ladder/investigation.md).
_LADDER_CPU = ("data.task.train_length=2", "data.task.min_length=2", "data.seq_len=9", "data.task.eval_samples=100",
               "train.max_steps=4500", "train.eval_every=500", "train.save_every=1500", "train.keep_last=1")
_LADDER_QUICK = ("model.d_model=16", "model.n_heads=2", "data.task.train_length=2", "data.task.min_length=2",
                 "data.seq_len=9", "data.task.eval_samples=2", "data.task.eval_alphas=[1, 2]", "data.val_batches=1",
                 "train.batch_size=4", "train.max_steps=4", "train.eval_every=2", "train.save_every=0",
                 "train.log_every=1", "train.sample_tokens=0", "train.device=cpu")
_LADDER_PAPER = ("model.d_model=384", "model.n_heads=6", "data.task.train_length=10", "data.task.min_length=10",
                 "data.seq_len=33", "train.max_steps=5000", "train.batch_size=64", "train.lr=3e-4",
                 "train.eval_every=500", "train.save_every=1000", "train.keep_last=1")


#: The halting-bias sweep (issue 28; investigation.md §4): every rung with ACT's weighted
#: readout at its default starting bias (UT's 1: σ ≈ 0.73, the weights sum to one after two
#: iterates, a readout 1.3 of 12 passes deep) and at these. −3 (σ ≈ 0.05: the weights spread
#: over every iterate) let UT+ACT learn the carry; −1 (σ ≈ 0.27: about four iterates) tells
#: whether the readout's depth or the starting bias's sign matters. The autoregressive TRM's
#: Q-halt is left out: in full-compute mode its readout is the last solution whatever its bias.
HALTING_BIASES = (-1.0, -3.0)
ACT_RUNGS = tuple(r for r in RUNGS if MECHANISMS[r][MECHANISM_NAMES.index("ACT")])


def _bias_sweep_runs() -> dict[str, RunSpec]:
    """``<rung>`` (its default bias) and ``<rung>@bias<b>`` for every ACT rung and b in HALTING_BIASES."""
    runs = {}
    for rung in ACT_RUNGS:
        runs[rung] = RunSpec("task-addition")
        runs.update({f"{rung}@bias{b:g}": RunSpec("task-addition", (f"model.halting.init_bias={b:g}",))
                     for b in HALTING_BIASES})
    return runs


def _ladder_sizes() -> dict[str, Size]:
    runs = {r: RunSpec("task-addition") for r in RUNGS}
    return {
        "quick": Size(runs, _LADDER_QUICK, seeds=2),
        "default": Size(runs, _LADDER_CPU, seeds=3,
                        wall_time="≈ 110 min on one thread, ≈ 55 min as two processes on 2 cores (21 runs of 4500 "
                                "steps; ≈ 0.07 s per step measured, 9 greedy evaluations of 5 α × 100 "
                                "problems per run)"),
        "bias-sweep-quick": Size(_bias_sweep_runs(), _LADDER_QUICK, seeds=2),
        "bias-sweep": Size(_bias_sweep_runs(), _LADDER_CPU, seeds=3,
                           wall_time="≈ 4.5 h on one thread, ≈ 2.3 h as two processes on 2 cores (27 runs of 4500 "
                                     "steps; the ACT rungs' runs of the default size and of the bias −3 rerun "
                                     "trained in 430-920 s each on this machine while it ran other jobs)"),
        "paper": Size(runs, _LADDER_PAPER, seeds=3,
                      wall_time="C = 24, d = 384, 6 heads, L_train = 10, 5000 steps of batch 64: on one H100 "
                                "about 10-20 minutes per rung"),
    }


def registered_ladder() -> Study:
    """``looplm study ladder``: addition at C = 12 with a learnable carry chain (CPU sizes)."""
    sizes = {k: v for k, v in _ladder_sizes().items() if k != "paper"}  # the paper size is C = 24
    return ladder_study("addition", 12, sizes=sizes, deviations=(
        "Operands of exactly 2 digits (L_train = 2, the paper: 10) so that the carry chain is learnt in a CPU "
        "hour: at d = 64 the last character stays at chance for Dense at L_train = 3 and 4 within 4500 steps, "
        "and for every rung at 10 within 2000 (docs/results/ladder/investigation.md).",
        "d = 64, 4 heads (the paper gives no width), C = 12; 4500 steps of batch 64 at lr 3e-4 with the library's "
        "1 % warmup and cosine decay to 10 % (the authors' code: constant rate), rotary positions (theirs: a "
        "learned absolute table), no dropout (theirs: 0.1).",
    ))


def paper_ladder() -> Study:
    """``looplm study ladder --paper``: C = 24, d = 384, 6 heads, L_train = 10 (the paper's size)."""
    return ladder_study("addition", 24, sizes={"paper": _ladder_sizes()["paper"]}, name="ladder")


