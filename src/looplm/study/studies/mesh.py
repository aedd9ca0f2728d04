"""Study ``mesh``: the recursive topologies against the vanilla model (mesh.txt Table 1)."""

from __future__ import annotations

from looplm.study import measures
from looplm.study.definition import Bars, Metric, PaperColumn, Size, Study
from looplm.study.studies.common import QUICK, VAL_LOSS, cpu_lm, lm_figures, preset_runs, stdlib_size


def _mesh_variants(dense: str, loop: str) -> dict[str, list[str]]:
    variants = {"vanilla": [f"model.layout={dense}", "model.topology={kind: base}"]}
    for name, kind in (("base", "base"), ("residual", "residual"), ("anchor_embedding", "anchor_embedding"),
                       ("anchor", "anchor"), ("mesh", "mesh")):
        variants[name] = [f"model.layout={loop}", f"model.topology={{kind: {kind}}}"]
    return variants


MESH = Study(
    name="mesh",
    title="MeSH: recursive variants against the vanilla model (mesh.txt Table 1, shrunk)",
    paper="mesh.txt (MeSH), Table 1; probes §2 Fig. 1, §4.1 Figs. 3-4",
    claim="at ~33 % fewer non-embedding parameters and the same block passes, base < residual ≈ anchor < mesh "
          "≈ vanilla in validation loss; mesh keeps larger updates and lower CKA between loop states than base",
    sizes={
        "quick": Size(preset_runs("tiny-base", _mesh_variants("4", "1+1R2+1")), QUICK + ("data.seq_len=16",), seeds=2),
        "default": Size(preset_runs("tiny-base", _mesh_variants("6", "1+2R2+1")),
                        ("model.d_model=96", "model.n_heads=4", *cpu_lm(600)), seeds=3,
                        wall_time="≈ 45 min on one thread (18 runs; ≈ 0.22 s per step measured, "
                                  "probes ≈ 2 s per run)"),
        "stdlib": stdlib_size(preset_runs("tiny-base", _mesh_variants("6", "1+2R2+1"))),
        "paper": Size(preset_runs("pythia-160m", _mesh_variants("12", "2+4R2+2")), seeds=3,
                      wall_time="Pythia-160M recipe; set data.source / data.tokenizer and train.max_steps to the "
                                "paper's 250B tokens: ≈ 2.4e20 training FLOPs per run, about a week per run on one "
                                "H100 at 40 % MFU (18 runs)"),
    },
    metrics=(VAL_LOSS, Metric("update", "update (all blocks)", 3, better="higher"),
             Metric("update_core", "update (core iter.)", 3, better="higher"),
             Metric("cka_loop", "CKA h⁽ᵗ⁾,h⁽ᵗ⁺¹⁾", 3, better="lower")),
    measure=measures.mesh_probes,
    # Table 1's reading: the recursive variants against plain recursion, anchor* against
    # anchor, mesh against the best fixed scheme and against the larger vanilla model
    comparisons=(("base", "vanilla"), ("residual", "base"), ("anchor", "base"), ("anchor_embedding", "base"),
                 ("anchor_embedding", "anchor"), ("mesh", "base"), ("mesh", "anchor"), ("mesh", "vanilla")),
    paper_columns=(PaperColumn(
        "Pile PPL (1B)", "mesh.txt Table 1, Pythia-1B rows (vanilla 16 layers; recursive 3+5R2+3, −31.3 % "
        "non-embedding parameters): Pile perplexity",
        {"vanilla": "7.96", "base": "8.20", "residual": "8.19", "anchor_embedding": "8.07", "anchor": "8.10",
         "mesh": "7.90"}),),
    figures=(*lm_figures(False), Bars("probes.png", ("update", "update_core", "cka_loop"),
                                       ("update (all)", "update (core)", "CKA loop"), "MeSH probes", "value")),
    deviations=(
        "Shrunk: vanilla 6 blocks against 1+2R2+1 (the 160M rows' −33 % shape), d = 96, byte-level pydoc "
        "corpus, 600 steps of 16 × 128 tokens; the paper trains Pythia 160M–1.4B on the Pile.",
        "The tiny blocks keep looplm's defaults (no √d embedding scale, no depth-scaled init, the Pythia "
        "recipe of App. B); the paper size uses it.",
        "Probes on 16 held-out sequences; the paper's anchor* is topology anchor_embedding.",
    ),
)


