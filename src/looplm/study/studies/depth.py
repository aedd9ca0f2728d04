"""Study ``depth`` (issue 27): fixed depth against the peers' recurrent-depth recipes: Mixture-of-
Recursions, Huginn's randomized depth and the zero-shot exit."""

from __future__ import annotations

from looplm.study import measures
from looplm.study.definition import Curve, Metric, RunSpec, Size, Study
from looplm.study.studies.common import QUICK, VAL_LOSS, cpu_lm, lm_figures, preset_runs, stdlib_size

#: Fixed depth: the loop every adaptive-depth variant is compared with (T = 3), and T = 2,
#: the realised block passes of MoR's hierarchical capacity (3/3, 2/3, 1/3 of the tokens).
_DEPTH_FIXED = {
    "fixed-T3": RunSpec("tiny-base", ("model.layout=1+2R3+1",)),
    "fixed-T2": RunSpec("tiny-base", ("model.layout=1+2R2+1",)),
}

#: Mixture-of-Recursions (Bae et al. 2025, §2.2.1; looplm.halting.mor): expert choice with the
#: causal threshold rule, with the paper's top-k training form (not causal in training; its
#: validation runs the threshold rule), with recursive KV sharing (§2.2.2: later recursions
#: attend over the first one's keys and values), and token choice.
_DEPTH_MOR = {
    "mor-expert": RunSpec("mor-tiny"),
    "mor-expert-topk": RunSpec("mor-tiny", ("model.halting.selection=top_k",)),
    "mor-expert-shared": RunSpec("mor-tiny-shared"),
    "mor-token": RunSpec("mor-tiny-token"),
}


# --- zero-shot exit (Huginn's criterion, Geiping et al. 2025 §6) on the fixed-depth loop: no
# variant of its own, columns on every trained loop: the loss it pays and the passes it saves
# at two thresholds (measures.ZERO_SHOT_EXITS), one evaluation of each trained run
DEPTH_EXIT_METRICS = (
    Metric("block_passes", "passes/token", 2),
    Metric("exit1_loss_paid", f"Δloss exit {measures.ZERO_SHOT_EXITS[0]}", 4, better="lower"),
    Metric("exit1_saved", f"saved exit {measures.ZERO_SHOT_EXITS[0]}", 1, percent=True, better="higher"),
    Metric("exit2_loss_paid", f"Δloss exit {measures.ZERO_SHOT_EXITS[1]}", 4, better="lower"),
    Metric("exit2_saved", f"saved exit {measures.ZERO_SHOT_EXITS[1]}", 1, percent=True, better="higher"),
)
DEPTH_EXIT_DEVIATIONS = (
    "Zero-shot exit: the paper (Huginn §6) exits per token while generating, reading p_t through its coda; "
    "here the exit is evaluated as a halting rule on the held-out split in one parallel forward, p_t read "
    "from the loop state (final norm and head: the logit lens when the layout has a coda), which keeps "
    "decoding equal to the full forward. Passes/token are realised block evaluations per token; the per-step "
    "LM head the criterion needs is in the FLOP count (looplm flops), not in the passes.",
)
# --- end of zero-shot exit


# --- Huginn's randomized depth (Geiping et al. 2025, arXiv 2502.05171 §3.3): a count drawn per
# step around r̄, backprop through the last k, against fixed-depth loops of the same shape at
# matched training FLOPs; every trained loop also gets the test-time compute curve (§5).
def _huginn_depth_variants(mean: int, window: int, matched: int) -> dict[str, list[str]]:
    """``matched``: the fixed count whose full-backprop training FLOPs equal the expected
    FLOPs of a drawn count around ``mean`` with window ``window`` (huginn-tiny at d = 64:
    T = 3 against r̄ = 4, k = 2, within 1 %: E[r] = 5, of which E[min(r, k)] ≈ 2 backpropagated).
    Rows in this order (DEPTH_COMPARISONS reads it): the matched fixed loop, the fixed count
    with the window, the drawn count."""
    return {
        f"huginn-fixed-T{matched}": [f"model.layout=2+4R{matched}+2", "model.depth={kind: fixed}"],
        f"huginn-fixed-T{mean}-k{window}": [f"model.layout=2+4R{mean}+2",
                                     f"model.depth={{kind: fixed, backprop_window: {window}}}"],
        f"huginn-r{mean}-k{window}": [f"model.layout=2+4R{mean}+2",
                                      f"model.depth={{kind: lognormal_poisson, sigma: 0.5, backprop_window: {window}}}"],
    }


#: size -> (preset, r̄, k, the matched fixed count)
_HUGINN_SHAPES = {"quick": ("huginn-tiny", 2, 1, 2), "default": ("huginn-tiny", 4, 2, 3),
                  "paper": ("huginn-3.5b", 32, 8, 15)}
DEPTH_HUGINN = {size: preset_runs(preset, _huginn_depth_variants(*shape))  # size -> runs
                for size, (preset, *shape) in _HUGINN_SHAPES.items()}

DEPTH_HUGINN_METRICS = (Metric("val_loss_at_max", "val loss at 4×T", 4, better="lower"),)
DEPTH_HUGINN_FIGURES = (Curve("test_time_compute.png", "loss_vs_iterations",
                              "validation loss against test-time iterations", "loop iterations r at inference",
                              "validation loss"),)
DEPTH_HUGINN_DEVIATIONS = (
    "Huginn rows: huginn-tiny's shape (2+4R·+2 sandwich blocks, concat_adapter, RMSNorm, SwiGLU) at d = 64 on "
    "pydoc bytes, 600 steps of 16 × 128 tokens; r̄ = 4 and k = 2 (the paper: r̄ = 32, k = 8, 800B tokens). "
    "≈ 30 min on one thread for its 9 runs (≈ 0.2 s per step for the fixed loops, ≈ 0.35 s for the drawn "
    "counts, measured and scaled by CPU time; the 16-point test-time curve ≈ 10 s per run).",
    "Matched training FLOPs: huginn-fixed-T3 runs T = 3 with full backprop, whose training FLOPs equal the expected "
    "FLOPs of r ~ P(e^τ) + 1 around r̄ = 4 with k = 2 (looplm's accounting, the no-grad iterations once) "
    "within 1 %; huginn-fixed-T4-k2 isolates the random count from the window.",
    "Validation runs the layout's T (r̄ for Huginn); the test-time curve reruns the final model at r = 1 … 4T "
    "on the same held-out batches (at r = T it is the val loss).",
)
# --- end of Huginn's randomized depth


def _depth_measure(run) -> dict:
    """Validation loss, FLOPs (drawn counts summed step by step) and the realised depth
    (:func:`measures.realised_depth`); every trained loop that can take it evaluated with the
    zero-shot exits (:func:`measures.zero_shot_exit`; blank for rules with parameters, e.g.
    MoR's routers) and run at r = 1 … 4T (:func:`measures.test_time_curve`)."""
    parts = [measures.realised_depth(run), measures.zero_shot_exit(run), measures.test_time_curve(run)]
    return {**parts[0], "scalars": {k: v for p in parts for k, v in p["scalars"].items()},
            "series": {k: v for p in parts for k, v in p["series"].items()}}


#: Each row against the baseline its claim names: the fixed T = 2 and every MoR row against
#: the T = 3 loop they come from, MoR against T = 2 (the fixed loop spending MoR's realised
#: passes: matched compute), Huginn's rows against their matched-FLOPs fixed loop.
DEPTH_COMPARISONS = (
    ("fixed-T2", "fixed-T3"),
    *((mor, "fixed-T3") for mor in _DEPTH_MOR),
    *((mor, "fixed-T2") for mor in _DEPTH_MOR),
    # per size, _huginn_depth_variants' rows in order: matched fixed loop, fixed with the window, drawn count
    *((row, matched) for matched, windowed, drawn in map(list, DEPTH_HUGINN.values()) for row in (drawn, windowed)),
)


def _depth_runs(size: str) -> dict[str, RunSpec]:
    """Every recipe's rows at ``size``: the fixed-depth and MoR blocks, then Huginn's."""
    return {**_DEPTH_FIXED, **_DEPTH_MOR, **DEPTH_HUGINN[size]}


DEPTH = Study(
    name="depth",
    title="Depth that adapts: fixed depth against the peers' recurrent-depth recipes (issue 27, CPU size)",
    paper="Mixture-of-Recursions (Bae et al. 2025, arXiv 2507.10524) §2.2.1 and §3; Huginn (Geiping et al. 2025, "
          "arXiv 2502.05171) §3.3, §5 and §6 (zero-shot exit); Ouro (Zhu et al. 2025, arXiv 2510.25741) §3.4",
    claim="per-token depth reaches the loss of the fixed loop it is cut from at the realised block passes of a "
          "shallower one (MoR: expert choice at 3/3, 2/3, 1/3 capacity ≈ 2 of 3 recursion steps per token); a "
          "fixed-depth loop can stop converged tokens early at inference (zero-shot exit) for a small loss; at "
          "matched training FLOPs a loop trained on a heavy-tailed count per step (Huginn) keeps improving when "
          "run for more iterations than its mean at test time, where a fixed-depth loop does not",
    sizes={
        "quick": Size(_depth_runs("quick"), QUICK + ("data.seq_len=16",), seeds=2),
        "default": Size(_depth_runs("default"), ("model.d_model=96", "model.n_heads=4", *cpu_lm(600)), seeds=3,
                        wall_time="≈ 75 min on one thread (24 runs of 600 steps; MoR rows not yet timed, Huginn's "
                                  "≈ 0.2 s per step for the fixed loops and ≈ 0.35 s for the drawn counts)"),
        "stdlib": stdlib_size(_depth_runs("default"), loss_rows=0),  # trained before train.loss_rows
        "paper": Size(DEPTH_HUGINN["paper"], seeds=1,
                      wall_time="Huginn-0125: 800B tokens on 4096 AMD MI250X GPUs; set data.source / "
                                "data.tokenizer and train.max_steps"),
    },
    metrics=(VAL_LOSS, *DEPTH_HUGINN_METRICS, Metric("passes", "block passes/token (realised)", 2, better="lower"),
             Metric("steps", "loop steps/token", 2),
             Metric("train_flops", "train FLOPs (as run)", 3, sci=True),
             Metric("train_flops_realised", "train FLOPs (realised)", 3, sci=True), *DEPTH_EXIT_METRICS[1:]),
    measure=_depth_measure,
    reference="fixed-T3",
    comparisons=DEPTH_COMPARISONS,
    figures=(*lm_figures(), *DEPTH_HUGINN_FIGURES),
    deviations=(
        "Two families of rows, each paired with its own baselines: fixed-T2 and mor-* share tiny-base's 1+2R3+1 "
        "shape (against fixed-T3, the loop MoR is cut from, and MoR against fixed-T2, the fixed loop that "
        "spends MoR's realised passes); huginn-* share huginn-tiny's 2+4R·+2 shape (against huginn-fixed-T3, "
        "their matched-FLOPs fixed loop).",
        *DEPTH_HUGINN_DEVIATIONS,
        "Shrunk: 1+2R3+1 blocks at d = 96 (MoR's Middle-Cycle sharing, N_r = 3), byte-level pydoc corpus, 600 steps "
        "of 16 × 128 tokens; the paper trains 135M–1.7B models on FineWeb-Edu at matched training FLOPs.",
        "Realised passes and FLOPs are measured on 16 held-out sequences in eval mode; looplm's batched forward "
        "computes every position at every step and freezes the ones that left (train FLOPs as run), MoR's "
        "reference gathers the selected tokens.",
        "MoR's KV policy in mor-expert / -topk / mor-token is looplm's: positions that left keep their keys "
        "from their frozen state; mor-expert-shared is the paper's recursive KV sharing (every later recursion "
        "attends over the first one's keys and values of all tokens); recursion-wise caching (kv: recursion) "
        "has no row.",
        *DEPTH_EXIT_DEVIATIONS,
    ),
)


