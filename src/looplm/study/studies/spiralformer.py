"""Study ``spiralformer``: coarse-to-fine loops against full-resolution ones (spiralformer.txt Table 1)."""

from __future__ import annotations

from looplm.study import measures
from looplm.study.definition import Metric, PaperColumn, Size, Study
from looplm.study.studies.common import QUICK, VAL_LOSS, cpu_lm, lm_figures, preset_runs, stdlib_size


def _spiral_variants(prelude: int, core: int, coda: int, l_prelude: int, l_coda: int) -> dict[str, list[str]]:
    return {
        "looped-T4-full-res": [f"model.layout={prelude}+{core}R4+{coda}"],
        "looped-T2": [f"model.layout={prelude}+{core}R2+{coda}"],
        "SpiralFormer-B": [f"model.layout={prelude}+{core}x{{1/8,1/4,1/2,1}}+{coda}"],
        "SpiralFormer-L": [f"model.layout={l_prelude}+{core}x{{1/16,1/8,1/4,1/2}}+{l_coda}"],
    }


SPIRALFORMER = Study(
    name="spiralformer",
    title="SpiralFormer-B and -L against full-resolution loops (spiralformer.txt Table 1, shrunk)",
    paper="spiralformer.txt (SpiralFormer), Table 1",
    claim="a coarse-to-fine loop (B) reaches the loss of the full-resolution loop at fewer FLOPs; "
          "L (more prelude/coda at the same FLOPs as B) is better still",
    sizes={
        "quick": Size(preset_runs("tiny-mesh", _spiral_variants(1, 1, 1, 1, 1)), QUICK + ("data.seq_len=32",), seeds=2),
        "default": Size(preset_runs("tiny-mesh", _spiral_variants(1, 2, 1, 2, 2)),
                        ("model.d_model=96", "model.n_heads=4", *cpu_lm(700)), seeds=3,
                        wall_time="≈ 45 min on one thread (12 runs; ≈ 0.30 s per step measured, "
                                  "the T = 4 loop 0.45)"),
        "stdlib": stdlib_size(preset_runs("tiny-mesh", _spiral_variants(1, 2, 1, 2, 2))),
        "paper": Size(preset_runs("spiralformer-b-160m", _spiral_variants(2, 4, 2, 4, 4)), seeds=3,
                      wall_time="Pythia-160M recipe; set data.source / data.tokenizer and train.max_steps to the "
                                "paper's 250B tokens: about a week per run on one H100 at 40 % MFU (12 runs)"),
    },
    metrics=(VAL_LOSS, Metric("forward_flops_per_token", "fwd FLOPs/token", 3, sci=True),
             Metric("train_flops", "train FLOPs", 3, sci=True)),
    measure=measures.lm,
    # Table 1: SpiralFormer against the full-resolution LoopedFormer (T = 2) and the full
    # loop of its own schedule; -L against -B
    comparisons=(("looped-T2", "looped-T4-full-res"), ("SpiralFormer-B", "looped-T4-full-res"),
                 ("SpiralFormer-B", "looped-T2"), ("SpiralFormer-L", "looped-T2"), ("SpiralFormer-L", "SpiralFormer-B")),
    paper_columns=(
        PaperColumn("Pile PPL (160M)", "spiralformer.txt Table 1, Pythia-160M rows: Pile perplexity "
                    "(LoopedFormer 2+4×{1,1}+2 is the paper's full-resolution loop, T = 2)",
                    {"looped-T2": "11.37", "SpiralFormer-B": "11.29", "SpiralFormer-L": "10.94"}),
        PaperColumn("prefill TFLOPs (160M)",
                    "spiralformer.txt Table 1, Pythia-160M rows: FLOPs of a 4096-token prefill",
                    {"looped-T2": "1.65", "SpiralFormer-B": "1.48", "SpiralFormer-L": "1.49"}),
    ),
    figures=lm_figures(),
    deviations=(
        "Shrunk: core of 2 blocks (paper 4), d = 96, pydoc bytes, 700 steps of 16 × 128 tokens; "
        "SpiralFormer-L is 2+2×{…}+2 (the tiny preset's) where the paper's is 4+4×{…}+4.",
        "The full-resolution loop at B's layout runs T = 4 (every iteration at resolution 1); the paper's "
        "LoopedFormer runs T = 2, also trained here.",
    ),
)


