"""Study ``sharing`` (issue 29): how much to relax the tied core: per-iteration LoRA and MoE FFNs.
Each block of rows belongs to one mechanism; a new mechanism adds its own block to
:func:`_sharing_variants`."""

from __future__ import annotations

from typing import Sequence

from looplm.study import measures
from looplm.study.definition import Metric, PaperColumn, Size, Study
from looplm.study.results import describe_default
from looplm.study.studies.common import (
    QUICK,
    STDLIB_SWEEP_COMPRESSED,
    VAL_LOSS,
    cpu_lm,
    lm_figures,
    preset_runs,
    stdlib_size,
)

SHARING_LOOP = "1+2R3+1"


# --- MoE FFN (looplm.modules.moe; MeSH App. E.7, Switch, OLMoE) ---
def _moe_sharing_variants(loop: str, ffn_hidden: int, experts: int = 8, top_k: int = 2) -> dict[str, list[str]]:
    """MoE FFNs at the dense FFN's active width on the loop ``loop``: ``experts`` experts of
    width ffn_hidden / top_k, so a token's k experts hold as many weights as the dense FFN
    (the tied core's FLOPs and active parameters, plus the router's d·E per block), shared
    by the loop's iterations or one set per iteration; and Switch's top-1 routing over half
    as many experts of the dense width (the shared top-k row's total and active parameters)."""
    def moe(n: int, k: int, extra: str = "") -> str:
        return f"model.moe={{experts: {n}, top_k: {k}, hidden: {ffn_hidden // k}, {extra}z_loss_weight: 0.001}}"

    layout = f"model.layout={loop}"
    return {"moe-shared": [layout, moe(experts, top_k)],
            "moe-per-iteration": [layout, moe(experts, top_k, "per_iteration: true, ")],
            "moe-top1": [layout, moe(experts // 2, 1)]}
# --- end of MoE FFN ---


def _sharing_variants(loop: str, lora_ranks: Sequence[int], ffn_hidden: int) -> dict[str, list[str]]:
    variants: dict[str, list[str]] = {"tied": [f"model.layout={loop}"]}
    # --- per-iteration LoRA (Relaxed Recursive Transformers, Bae et al. 2024 §2.3) ---
    for rank in lora_ranks:
        variants[f"lora-r{rank}"] = [f"model.layout={loop}", f"model.lora.rank={rank}"]
    # --- end of per-iteration LoRA ---
    variants.update(_moe_sharing_variants(loop, ffn_hidden))  # the MoE FFN block
    return variants


def describe_with_costs(variant: str, runs: list) -> dict[str, str]:
    """Layout, non-embedding parameters, active parameters per token (a mixture of experts
    uses k of its E experts) and training FLOPs per token of a row's first run."""
    from looplm.accounting import active_parameter_count

    first = runs[0]
    flops = first.summary.get("model_flops_per_token")
    return {**describe_default(variant, runs), "params (active)": f"{active_parameter_count(first.config.model):,}",
            "train FLOPs/token": f"{flops:.3g}" if flops else "–"}


SHARING = Study(
    name="sharing",
    title="Relaxed sharing of the looped core: tied against per-iteration LoRA and MoE FFNs",
    paper="Bae et al. 2024, Relaxed Recursive Transformers (arXiv 2410.20672) §2.3; mesh.txt App. E.7 (an OLMoE "
          "backbone in a 4+8R2+4 loop); MoEUT (Csordás et al. 2024); issue 29",
    claim="per-iteration LoRA on the tied core lowers the loss of the tied loop at a small cost in parameters "
          "and FLOPs, more with a higher rank; experts add capacity to the tied core at the same active "
          "parameters and FLOPs, and a set per iteration lets the iterations differ",
    sizes={
        "quick": Size(preset_runs("tiny-base", _sharing_variants("1+1R2+1", (2, 4), 64)), QUICK + ("data.seq_len=16",),
                      seeds=1),
        "default": Size(preset_runs("tiny-base", _sharing_variants(SHARING_LOOP, (4, 16), 384)),
                        ("model.d_model=96", "model.n_heads=4", *cpu_lm(600)), seeds=3,
                        wall_time="≈ 80 min on one thread (18 runs of 600 steps; estimated from the mesh study's "
                                  "0.22 s per step at the same width and block passes, MoE steps taken as 1.5× "
                                  "slower: not timed)"),
        # the dense FFN 512 wide, experts 256
        "stdlib": stdlib_size(preset_runs("tiny-base", _sharing_variants(SHARING_LOOP, (4, 16), 512)),
                               STDLIB_SWEEP_COMPRESSED, loss_rows=0),  # trained before train.loss_rows
    },
    metrics=(VAL_LOSS, Metric("forward_flops_per_token", "fwd FLOPs/token", 3, sci=True)),
    measure=measures.lm,
    describe=describe_with_costs,
    paper_columns=(PaperColumn(
        "Pile PPL (E.7)", "mesh.txt Table 9: the OLMoE backbone (2.6B total, 512M active) as the 4+8R2+4 loop "
        "with the base topology, its experts shared by the two iterations (vanilla 24 layers: 7.31)",
        {"moe-shared": "7.60"}),),
    figures=lm_figures(),
    deviations=(
        "From scratch on the byte-level pydoc corpus (the paper converts pretrained Gemma / TinyLlama / Pythia "
        "and up-trains: see the conversion study): the adapters start at B_t = 0, the tied model.",
        "Ranks 4 and 16 at d = 96 (the paper: 64-512 at d = 2048); one rank-r adapter on the fused q/k/v "
        "projection where the paper has one each on q, k and v; no α/r scaling.",
        "MoE rows: 8 experts of 192, top-2 (moe-top1: 4 of 384, top-1) at d = 96, against the tied core's dense "
        "GELU FFN of 384, on the byte-level pydoc corpus; the paper's E.7 trains the 2.6B OLMoE backbone on the "
        "Pile. Experts have no biases (OLMoE's), the dense FFN has tiny-base's.",
        "Matched FLOPs and, for shared experts, active parameters up to the routers (d·E per block: 768 "
        "parameters, 1 % of the FFN's FLOPs) and the dense FFN's biases; a set per iteration uses k experts of "
        "each iteration's set, so its active count is larger at the same FLOPs. MoE rows add the balance (0.01) "
        "and z (0.001) losses to the training loss, not to the validation loss.",
    ),
)


