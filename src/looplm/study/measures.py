"""What the studies read from a finished run: validation loss over training and over
training FLOPs (looplm's accounting), SGT's growth decisions, the MeSH probes, the
character tasks' greedy accuracies and the state-tracking curriculum's n_max.

Each function takes a :class:`~looplm.study.runs.Run` and returns
:data:`~looplm.study.definition.Measures` (``scalars``, ``series``, ``notes``).
"""

from __future__ import annotations

from typing import Any, Optional

from looplm.data.source_kinds import TaskSource
from looplm.study.definition import Measures
from looplm.study.runs import Run, validation


def _flops_per_step(run: Run, convention: str, model=None) -> float:
    """Training FLOPs of one optimiser step: a batch of ``train.batch_size`` sequences of
    ``data.seq_len`` tokens (forward and backward, :attr:`FlopReport.training`) at the
    structure the model has at initialisation (SGT: nothing grown yet)."""
    from looplm.accounting import count_flops

    cfg = run.config
    return count_flops(model if model is not None else cfg.model, cfg.data.seq_len, batch=cfg.train.batch_size,
                       convention=convention).training


def lm(run: Run, convention: str = "default") -> Measures:
    """See :func:`_lm`."""
    return _lm(run, convention)[0]


def _lm(run: Run, convention: str) -> tuple[Measures, float]:
    """Final validation loss; training FLOPs to the end, per step summed (a grown SGT
    structure is counted step by step, :func:`grown_flops`); forward FLOPs per token; the
    validation-loss curve over steps and over cumulative training FLOPs; and one step's
    training FLOPs at the initial structure."""
    from looplm.accounting import count_flops
    from looplm.accounting.flops import build_meta_model

    cfg = run.config
    model = build_meta_model(cfg.model)  # one meta-device model for every count (building one is the slow part)
    evals, val_loss = validation(run)
    steps = run.summary.get("steps", cfg.train.max_steps)
    base = _flops_per_step(run, convention, model)
    if cfg.model.head_loop is not None:
        cumulative = grown_flops(run, convention, model)
    elif cfg.model.depth.sampled:
        cumulative = sampled_depth_flops(run, convention, model)
    else:
        cumulative = [base * s for s in range(steps + 1)]
    forward = count_flops(model, cfg.data.seq_len, convention=convention)
    return {
        "scalars": {
            "val_loss": val_loss,
            "train_flops": cumulative[min(steps, len(cumulative) - 1)],
            "forward_flops_per_token": forward.forward / cfg.data.seq_len,
        },
        "series": {
            "val_loss": [[e["step"], e["val_loss"]] for e in evals],
            "val_loss_flops": [[cumulative[min(e["step"], len(cumulative) - 1)], e["val_loss"]] for e in evals],
        },
        "notes": [],
    }, base


def grown_flops(run: Run, convention: str = "sgt", model=None) -> list[float]:
    """Cumulative training FLOPs after each step 0 … steps of an SGT run, from the structure
    its ``growth`` events describe (sparse-growing-transformer.txt §4, Tables 1-2: the sum
    over steps of each step's training FLOPs under the structure it ran with). Step s runs
    with the structure written after step s − 1; an activated layer loops all heads until
    its fade ends (a ``drop`` event), then only the selected heads."""
    from looplm.accounting.flops import build_meta_model
    from looplm.accounting.growth import training_flops_over_steps

    cfg = run.config
    loop = cfg.model.head_loop
    steps = run.summary.get("steps", cfg.train.max_steps)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for e in run.events_all("growth"):
        by_step.setdefault(e["step"], []).append(e)
    state: dict[int, tuple[int, Optional[list[float]]]] = {}
    structures = []
    for step in range(1, steps + 1):
        structures.append(dict(state))
        for e in by_step.get(step, []):
            layer = e.get("layer")
            if layer is None or e["action"] == "hold":
                continue
            if e["action"] in ("activate", "deepen", "freeze"):
                heads = e.get("heads")
                faded = e["action"] == "activate" and (loop.kind == "block" or getattr(loop, "fade_steps", 0) > 0)
                weights = None if heads is None or faded else [1.0 if i in heads else 0.0
                                                               for i in range(cfg.model.n_heads)]
                keep = state.get(layer, (0, None))[1] if e["action"] != "activate" else weights
                state[layer] = (int(e["depth"]), keep)
            elif e["action"] == "drop":
                state[layer] = (int(e["depth"]), [1.0 if i in e["heads"] else 0.0 for i in range(cfg.model.n_heads)])
    model = model if model is not None else build_meta_model(cfg.model)
    cost: dict[tuple, float] = {}
    cumulative = [0.0]
    for structure in structures:
        key = tuple(sorted((l, k, None if w is None else tuple(w)) for l, (k, w) in structure.items()))
        if key not in cost:
            cost[key] = training_flops_over_steps(model, cfg.data.seq_len, cfg.train.batch_size, [structure],
                                                  convention=convention)
        cumulative.append(cumulative[-1] + cost[key])
    return cumulative


def sampled_depth_flops(run: Run, convention: str = "default", model=None) -> list[float]:
    """Cumulative training FLOPs after each step 0 … steps of a run whose ``model.depth``
    draws the count per step (Huginn, arXiv 2502.05171 §3.3): step s ran the count drawn for
    (``train.seed``, s), its first r − k iterations without gradient (counted once)."""
    from looplm.accounting import count_flops
    from looplm.accounting.flops import build_meta_model

    cfg = run.config
    steps = run.summary.get("steps", cfg.train.max_steps)
    model = model if model is not None else build_meta_model(cfg.model)
    cost: dict[int, float] = {}
    cumulative = [0.0]
    for step in range(steps):
        r = cfg.model.depth.count(cfg.model.iterations, cfg.train.seed, step)
        if r not in cost:
            cost[r] = count_flops(model, cfg.data.seq_len, batch=cfg.train.batch_size, convention=convention,
                                  iterations=r).training
        cumulative.append(cumulative[-1] + cost[r])
    return cumulative


def test_time_curve(run: Run, factor: int = 4) -> Measures:
    """The test-time compute curve (arXiv 2502.05171 §5, Figs. 1 and 7): the validation loss
    of the final model run at r = 1 … ``factor``·T iterations (T: the trained mean r̄, or the
    fixed count) as the series ``loss_vs_iterations``, and its value at ``factor``·T
    (``val_loss_at_max``), on the held-out batches training validated on (so at r = T the
    curve is the run's ``val_loss``). None for a model that runs only its trained count (a
    dense layout, per-iteration parameters: the model refuses the count, naming why)."""
    from looplm.config_base import ConfigError
    from looplm.eval.validation import evaluate_run

    trained = run.config.model.iterations
    none = {"scalars": {"val_loss_at_max": None}, "series": {}, "notes": []}
    if not run.config.model.parsed_layout.is_looped:
        return none
    try:
        curve = [[r, evaluate_run(run.run_dir, iterations=r, verify=False,
                                  batch_size=run.config.train.batch_size)["val_loss"]]
                 for r in range(1, factor * trained + 1)]
    except ConfigError:
        return none
    return {"scalars": {"val_loss_at_max": curve[-1][1]}, "series": {"loss_vs_iterations": curve}, "notes": []}


def growth(run: Run) -> Measures:
    """SGT: :func:`lm` in SGT's FLOP convention, the compute overhead over the same model
    without growth, and the growth decisions as notes."""
    measures, per_step = _lm(run, "sgt")
    base = per_step * run.summary.get("steps", run.config.train.max_steps)
    measures["scalars"]["flops_overhead"] = measures["scalars"]["train_flops"] / base - 1.0
    decisions = [e for e in run.events_all("growth") if e["action"] not in ("hold",)]
    measures["scalars"]["looped_layers"] = float(len({e["layer"] for e in decisions if e["action"] == "activate"}))
    measures["notes"] = [
        f"step {e['step']}: {e['action']} {e.get('block') or e.get('layer')} "
        f"(depth {e.get('depth')}, heads {e.get('heads')})"
        for e in decisions
    ]
    return measures


def mesh_probes(run: Run, samples: int = 16) -> Measures:
    """:func:`lm` plus the MeSH probes (mesh.txt §2 Fig. 1, §4.1 Figs. 3-4) on ``samples``
    held-out sequences: ``update`` the mean relative update magnitude
    2‖f(h)−h‖/(‖f(h)‖+‖h‖) over every block call; ``update_core`` the same for the whole
    core stack per iteration (loops only); ``cka_loop`` the mean RBF-CKA between consecutive
    loop states h⁽ᵗ⁾, h⁽ᵗ⁺¹⁾ (loops only; high = the stagnation MeSH reports for ``base``)."""
    from looplm.probes import ProbeError, load_probe_input
    from looplm.probes.mesh import cka_probe, update_magnitude

    measures = lm(run)
    probe = load_probe_input(run.run_dir, samples=samples, batch_size=min(8, samples))
    update = update_magnitude(probe).numbers
    blocks = [b["mean"] for b in update["blocks"]]
    core = [c["mean"] for c in update["core_iterations"]]
    cka_loop = None
    try:
        cka = cka_probe(probe).numbers
        names = cka["states"]
        loop = [i for i, n in enumerate(names) if n.startswith("h^(")]
        pairs = [cka["cka"][i][j] for i, j in zip(loop, loop[1:])]
        cka_loop = sum(pairs) / len(pairs) if pairs else None
    except ProbeError:  # no loop (the vanilla model)
        pass
    measures["scalars"].update({
        "update": sum(blocks) / len(blocks) if blocks else None,
        "update_core": sum(core) / len(core) if core else None,
        "cka_loop": cka_loop,
    })
    return measures


def state_tracking(run: Run) -> Measures:
    """LT2 §4.6: n_max, the largest n = m of the curriculum passed (0 when none was), and the
    accuracy at the last evaluation, with the n_max curve over steps."""
    history = run.events("task_eval")
    final = history[-1] if history else {}
    return {
        "scalars": {"n_max": float(final.get("n_max") or 0), "state_acc": final.get("accuracy")},
        "series": {"n_max": [[e["step"], float(e.get("n_max") or 0)] for e in history]},
        "notes": [],
    }


def lt2(run: Run) -> Measures:
    """The LM part of an LT2 variant (:func:`lm` and :func:`attention_sink`) or its
    state-tracking part."""
    if isinstance(run.config.data.parsed_source, TaskSource):
        return state_tracking(run)
    measures, sink = lm(run), attention_sink(run)
    measures["scalars"].update(sink["scalars"])
    measures["series"].update(sink["series"])
    return measures


def attention_sink(run: Run, samples: int = 16) -> Measures:
    """LT2 §4.4's attention-sink measurement: the first-token attention mass (the softmax
    probability queries q ≥ 1 give key 0, :func:`looplm.probes.residual.first_token_mass`)
    of the core blocks, averaged per loop iteration, on ``samples`` held-out sequences:
    ``sink_first`` (the first iteration), ``sink_last`` (the last) and the series
    ``sink_by_loop`` [[t, mass]]. For a dense layout the whole model is iteration 0. None
    where no block has softmax probabilities (linear mixers)."""
    from looplm.probes import load_probe_input
    from looplm.probes.residual import unrolled_diagnostics

    numbers = unrolled_diagnostics(load_probe_input(run.run_dir, samples=samples, batch_size=min(8, samples))).numbers
    by_loop: dict[int, list[float]] = {}
    looped = run.config.model.parsed_layout.is_looped
    for label, mass in zip(numbers["unrolled"], numbers["first_token_mass"]):
        if mass is None or (looped and not label.startswith("core")):
            continue
        t = int(label.rsplit("@", 1)[1]) if "@" in label else 0
        by_loop.setdefault(t, []).append(mass)
    means = [[t, sum(v) / len(v)] for t, v in sorted(by_loop.items())]
    return {"scalars": {"sink_first": means[0][1] if means else None, "sink_last": means[-1][1] if means else None},
            "series": {"sink_by_loop": means}, "notes": []}


def character_task(run: Run, reference: str = "1") -> Measures:
    """The ladder's final greedy evaluation (autoregressive-trm.txt §5, App. B.3): exact match
    ``em@α`` and character accuracy ``char@α`` at every α (at α ≤ 1 on held-out problems, never
    trained on); ``em_seen`` / ``char_seen`` on training problems at L_train (the gap between
    them is memorisation; None with ``data.task.heldout=0``); by output quartile ``q1``–``q4``
    and of the last character ``last`` at α = ``reference`` (Figs. 4-5); curves of character
    and last-character accuracy over training (Figs. 5-6) and of accuracy against α."""
    history = run.events("task_eval")
    final = history[-1]["alphas"]
    ref = reference if reference in final else next(iter(final))
    scalars: dict[str, Optional[float]] = {}
    for key, m in final.items():
        scalars[f"em@{key}"] = m["exact_match"]
        scalars[f"char@{key}"] = m["char_acc"]
    for q, value in enumerate(final[ref]["quartile_acc"], 1):
        scalars[f"q{q}"] = value
    scalars["last"] = final[ref]["last_char_acc"]
    seen = history[-1].get("seen")  # data.task.heldout > 0: the same metrics on training problems at L_train
    scalars["em_seen"] = None if seen is None else seen["exact_match"]
    scalars["char_seen"] = None if seen is None else seen["char_acc"]
    return {
        "scalars": scalars,
        "series": {
            "char": [[e["step"], e["alphas"][ref]["char_acc"]] for e in history],
            "last": [[e["step"], e["alphas"][ref]["last_char_acc"]] for e in history],
            "length": [[m["alpha"], m["char_acc"]] for m in final.values()],
        },
        "notes": [],
    }


#: held-out problems the ladder's halting measure reads (investigation.md's probes read 64 rows)
HALTING_SAMPLES = 64


def halting_readout(run: Run, samples: int = HALTING_SAMPLES) -> Measures:
    """Where a halting rung reads out (autoregressive-trm.txt App. B.1; the readout depth of
    docs/results/ladder/investigation.md §4), over the answer characters (the scored
    positions) of the first ``samples`` held-out problems: ``readout_depth``, the block passes
    behind the readout (:func:`~looplm.probes.halting.readout_passes`: ACT's expected depth
    Σ_τ w_τ·τ·passes per step; Q-halt's terminal readout, the passes run), and per macro step
    τ the mean ACT weight w_τ (series ``halting_weight``) or Q-halt σ(q) (``q_halt``). None
    and no series without a halting rule."""
    import torch

    from looplm.probes import load_probe_input
    from looplm.probes.halting import readout_passes
    from looplm.targets import IGNORE_INDEX

    cfg = run.config.model
    if cfg.halting.kind == "none":
        return {"scalars": {"readout_depth": None}, "series": {}, "notes": []}
    probe = load_probe_input(run.run_dir, samples=samples, batch_size=samples)
    depth, count = 0.0, 0
    by_step: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for inputs, targets in probe.batches:
            out = probe.model(inputs)
            scored = targets != IGNORE_INDEX
            depth += float(readout_passes(out, cfg.passes_per_step)[scored].sum())
            count += int(scored.sum())
            for name, values in out.record.items():
                if name in ("act_weights", "q_halt"):
                    sums = torch.stack([v.double()[scored].sum() for v in values])
                    # steps a stopped loop skipped weigh nothing
                    sums = torch.nn.functional.pad(sums, (0, cfg.iterations - len(sums)))
                    by_step[name] = by_step.get(name, 0) + sums
    series = {{"act_weights": "halting_weight"}.get(name, name): [[t, float(v) / count] for t, v in enumerate(sums, 1)]
              for name, sums in by_step.items()}
    return {"scalars": {"readout_depth": depth / count}, "series": series, "notes": []}


def ladder_rung(run: Run) -> Measures:
    """The ladder's measure: :func:`character_task` and :func:`halting_readout`."""
    measures, halting = character_task(run), halting_readout(run)
    measures["scalars"].update(halting["scalars"])
    measures["series"].update(halting["series"])
    return measures


#: the zero-shot exits the depth study evaluates every trained loop with (Huginn's KL criterion
#: at its default threshold, 5e-4, and ten times looser)
ZERO_SHOT_EXITS = ("kl:5e-4", "kl:5e-3")


def zero_shot_exit(run: Run, exits: tuple[str, ...] = ZERO_SHOT_EXITS) -> Measures:
    """The full loop's realised block passes per token on the run's held-out split, and for
    each zero-shot exit (:mod:`looplm.eval.adaptive_exit`; Huginn, Geiping et al. 2025 §6)
    the loss it pays against the full loop (``exitN_loss_paid``) and the share of block
    passes it saves (``exitN_saved``), N = 1, 2, … in ``exits`` order. None where the run
    cannot take the exit (no loop, a halting rule with parameters, a topology that cannot
    freeze a position)."""
    from looplm.config_base import ConfigError
    from looplm.eval.adaptive_exit import ExitSpec
    from looplm.eval.validation import evaluate_run

    names = [key for i in range(1, len(exits) + 1) for key in (f"exit{i}_loss_paid", f"exit{i}_saved")]
    try:
        result = evaluate_run(run.run_dir, exits=[ExitSpec.parse(spec) for spec in exits],
                              batch_size=run.config.train.batch_size)
    except ConfigError:
        return {"scalars": {"block_passes": None, **dict.fromkeys(names)}, "series": {}, "notes": []}
    scalars = {"block_passes": result["block_passes_per_token"]}
    for i, row in enumerate(result["exits"], start=1):
        scalars.update({f"exit{i}_loss_paid": row["loss_paid"], f"exit{i}_saved": row["compute_saved"]})
    return {"scalars": scalars, "series": {}, "notes": []}
def realised_depth(run: Run, samples: int = 16) -> Measures:
    """:func:`lm` plus what an adaptive-depth model spent on ``samples`` held-out sequences
    (eval mode): ``passes``, the mean block passes per token it needed
    (:func:`~looplm.accounting.realised_block_passes`; a dense model: its blocks), ``steps``,
    the mean loop steps per token, and ``train_flops_realised``: ``train_flops`` with the core
    blocks of the steps after the first charged at the realised share of them ((steps − 1) /
    (iterations − 1): every position takes the first step; the rest of the step as counted;
    the later steps may cost less than the first, as under MoR's recursive KV sharing). The
    batched forward computes frozen positions too (looplm's halting freezes, it does not
    gather): the realised count is what a gathering kernel would run, ``train_flops`` what
    this one runs."""
    import torch

    from looplm.accounting import count_flops, execution_plan, realised_block_passes
    from looplm.accounting.cost import module_cost
    from looplm.accounting.flops import build_meta_model
    from looplm.probes import load_probe_input

    measures = lm(run)
    cfg = run.config
    probe = load_probe_input(run.run_dir, samples=samples, batch_size=min(8, samples))
    passes, steps, count = 0.0, 0.0, 0
    with torch.no_grad():
        for inputs, _ in probe.batches:
            out = probe.model(inputs)
            n = inputs.numel()
            passes += (cfg.model.block_passes if out.block_passes is None else realised_block_passes(out)) * n
            steps += (0.0 if out.halt_steps is None else float(out.halt_steps.float().mean())) * n
            count += n
    report = count_flops(cfg.model, cfg.data.seq_len, batch=cfg.train.batch_size)
    looped, iterations = cfg.model.parsed_layout.is_looped, cfg.model.iterations
    unused = (iterations - steps / count) / (iterations - 1) if looped and iterations > 1 else 0.0
    later_core = sum(module_cost(s.module, s.call).flops(report.convention)
                     for s in execution_plan(build_meta_model(cfg.model), cfg.data.seq_len, cfg.train.batch_size)
                     if s.component == "core" and s.call.iteration > 0) if unused else 0.0
    core_share = report.convention.training_multiplier * later_core / report.training
    measures["scalars"].update({
        "passes": passes / count,
        "steps": steps / count if looped else None,
        "train_flops_realised": measures["scalars"]["train_flops"] * (1.0 - unused * core_share),
    })
    return measures
