"""Study ``conversion`` (issue 29): a dense model, trained here, converted into a loop
(hf/convert.py) with each shared-weight init, with and without per-iteration LoRA from the
SVD of the residuals, then up-trained for the same steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from looplm.config import RunConfig
from looplm.study import measures
from looplm.study.definition import Metric, RunSpec, Size, Study
from looplm.study.studies.common import QUICK, VAL_LOSS, cpu_lm
from looplm.study.studies.sharing import describe_with_costs

CONVERSION_LAYOUT = "1+2R2+1"
#: variant -> (init, rank)
_CONVERTED = {"tied-average": ("average", 0), "tied-stepwise": ("stepwise", 0),
              "lora-average": ("average", 16), "lora-stepwise": ("stepwise", 16)}


def _conversion_runs(dense_steps: int, uptrain_steps: int) -> dict[str, RunSpec]:
    runs = {"dense": RunSpec("tiny-dense", ("model.layout=6", f"train.max_steps={dense_steps}"))}
    for name, (_, rank) in _CONVERTED.items():
        runs[name] = RunSpec("tiny-dense", (f"model.layout={CONVERSION_LAYOUT}", f"model.lora.rank={rank}",
                                            f"train.max_steps={uptrain_steps}", "train.save_every=0"))
    return runs


def _converted_start(run_dir: Path) -> Path:
    return run_dir.parent / f"{run_dir.name}-converted"


def _conversion_build(study: Study, size: str, out_dir: Path, seed: int, overrides: Sequence[str]):
    """The preset runs; each converted run starts from ``<its run dir>-converted``, which
    :func:`_convert_dense_run` writes from this seed's dense run before it trains."""
    from looplm.study.definition import preset_configs

    configs = preset_configs(study.size(size), out_dir, seed, overrides)
    for name in _CONVERTED:
        cfg = configs[name]
        start = _converted_start(Path(cfg.train.out_dir))
        configs[name] = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(start)))
    return configs


def _convert_dense_run(name: str, cfg: RunConfig) -> None:
    """Write a converted run's start (``train.init_from``) from the dense run of its seed:
    hf/convert.py's layer map under its init, adapters from the residuals' truncated SVD."""
    if name not in _CONVERTED:
        return
    from looplm.hf.convert import convert_model
    from looplm.model import LoopLM

    start = Path(cfg.train.init_from)
    if (start / "manifest.json").is_file():
        return
    run_dir = Path(cfg.train.out_dir)
    dense = LoopLM.from_pretrained(run_dir.parent.parent / "dense" / run_dir.name)
    init, rank = _CONVERTED[name]
    model, _, _ = convert_model(dense, CONVERSION_LAYOUT, init, [("model.lora.rank", rank)])
    model.save_pretrained(start)


CONVERSION = Study(
    name="conversion",
    title="Dense into loop: average / stepwise init, with and without per-iteration LoRA",
    paper="Bae et al. 2024, Relaxed Recursive Transformers (arXiv 2410.20672) §2.2 (init), §2.3 (LoRA, SVD init); "
          "issue 29",
    claim="SVD-initialised per-iteration LoRA recovers much of the gap between the tied loop and the dense model; "
          "the paper compares shared-weight inits (average, stepwise) for both (which is best is read from the "
          "seeds here; the paper's text was not available to check its ranking)",
    sizes={
        "quick": Size(_conversion_runs(4, 4), QUICK + ("data.seq_len=16",), seeds=1),
        "default": Size(_conversion_runs(600, 200), ("model.d_model=96", "model.n_heads=4", *cpu_lm(600)),
                        seeds=3, wall_time="≈ 30 min on one thread (dense 600 steps, four up-trainings of 200; "
                                           "estimated from the mesh study's per-step time, not timed)"),
    },
    metrics=(VAL_LOSS, Metric("forward_flops_per_token", "fwd FLOPs/token", 3, sci=True)),
    measure=measures.lm,
    describe=describe_with_costs,
    build=_conversion_build,
    prepare=_convert_dense_run,
    deviations=(
        "The dense model is trained here (6 blocks, d = 96, 600 steps of pydoc bytes), standing in for a "
        "pretrained Pythia; the loop is 1+2R2+1 (the paper's 1+nR2+1 shape at n = 2); the dense row's loss is "
        "after its pretraining, the others' after 200 more steps from the converted start.",
        "LoRA rank 16 at d = 96 on every core linear (fused q/k/v: one adapter); the tied norms and biases are "
        "averaged/selected, so even a full-rank adapter would not start exactly at the dense model.",
    ),
)


