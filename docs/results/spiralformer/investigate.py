"""Why SpiralFormer-B trails the full-resolution loop in the default study: controlled runs.

The study (results.md) finds B 0.08 nats behind the T = 2 loop of its layout, where
spiralformer.txt Table 1 has it ahead. This script changes one thing at a time from the
study's default size (seed 0, whose B - T2 gap is 0.095; the seed-to-seed std is 0.016)
and trains B and the T = 2 loop under each change, so every row says whether that change
closes the gap. The causes tested are the ones the issue names (training horizon, learning
rate, initialisation of the new parameters, width) and two this corpus suggests (byte
tokens, short sequences). Run from the repository root:

    python docs/results/spiralformer/investigate.py [--out runs/spiral-inv] [--only NAME ...]

Each run is an ordinary ``looplm train`` of the ``tiny-mesh`` preset with the study's
overrides plus the experiment's; finished runs are reused. Writes investigation-runs.md
beside this file (the reading of it is investigation.md). One thread per run; about 90
CPU-minutes in all on a 2-core EPYC.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from looplm.study import get_study

HERE = Path(__file__).resolve().parent
#: The study's default size, read from its definition (so the runs here cannot drift from it);
#: seed 0, and no checkpoints (a run here is not resumed).
_SIZE = get_study("spiralformer").size("default")
PRESET = _SIZE.runs["looped-T2"].preset
STUDY = (*_SIZE.shared, "train.save_every=0", "train.seed=0", "data.seed=0")
LAYOUTS = {"T2": _SIZE.runs["looped-T2"].overrides[0], "B": _SIZE.runs["SpiralFormer-B"].overrides[0]}
BPE = "runs/spiral-inv/bpe-1024.json"

# name: (question, overrides applied to both variants, variants, patch)
EXPERIMENTS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], str | None]] = {
    "baseline": ("the study's default size, seed 0", (), ("T2", "B"), None),
    "core-once": ("do B's three coarse iterations add anything over running the core once at full resolution?",
                  (), ("core-once",), None),
    "gain-1": ("initialisation of the new path: up-scaling gain λ_t = 1 instead of √g_t", (), ("B",), "gain"),
    "mean-uniform": ("no learned routers: mean pooling + uniform broadcast (Table 2 row 5c)",
                     ("model.resolution={down: mean, up: uniform}",), ("B",), None),
    "bpe-1024": ("sub-word tokens: a 1024-entry BPE trained on the corpus (8 tokens ≈ 23 bytes, not 8)",
                 (f"data.tokenizer={BPE}", "model.vocab_size=1024", "data.seq_len=64", "train.batch_size=16"),
                 ("T2", "B"), None),
    "half-first": ("one coarse iteration instead of three: 1+2x{1/2,1}+1", (), ("half-first",), None),
    "seq-512": ("sequence length 512 at the same tokens per step (batch 4)",
                ("data.seq_len=512", "train.batch_size=4", "model.max_seq_len=512"), ("T2", "B"), None),
    "lr-1e-3": ("learning rate 1e-3 (study: 2e-3)", ("train.lr=0.001",), ("T2", "B"), None),
    "lr-4e-3": ("learning rate 4e-3 (study: 2e-3)", ("train.lr=0.004",), ("T2", "B"), None),
    "lr-4e-3-seed-1": ("learning rate 4e-3, seed 1", ("train.lr=0.004", "train.seed=1", "data.seed=1"), ("T2", "B"),
                       None),
    "lr-4e-3-seed-2": ("learning rate 4e-3, seed 2", ("train.lr=0.004", "train.seed=2", "data.seed=2"), ("T2", "B"),
                       None),
    "width-144": ("width: d = 144 (study: 96)", ("model.d_model=144",), ("T2", "B"), None),
    "horizon-2x": ("training horizon: 1400 steps instead of 700 (2x the tokens)",
                   ("train.max_steps=1400", "train.eval_every=175"), ("T2", "B"), None),
}
EXTRA_LAYOUTS = {"core-once": "model.layout=1+2R1+1", "half-first": "model.layout=1+2x{1/2,1}+1"}

PATCH = {"gain": (
    "import looplm.resolution.recursion as r, looplm.resolution.upscale as u\n"
    "def build_up(kind, dim, chunk):\n"
    "    m = u.build_up(kind, dim, chunk); m.gain = 1.0; return m\n"
    "r.build_up = build_up\n")}


def train_bpe(path: Path, vocab: int = 1024) -> None:
    """A byte-level BPE of the pydoc corpus (the study's data), saved as a tokenizers JSON."""
    if path.exists():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from looplm.data.config import DataConfig
    from looplm.data.sources import iter_documents

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(iter_documents(DataConfig(source="pydoc"))), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))


def run(out: Path, experiment: str, variant: str) -> dict:
    question, overrides, _, patch = EXPERIMENTS[experiment]
    layout = EXTRA_LAYOUTS.get(variant) or LAYOUTS[variant]
    run_dir = out / experiment / variant
    summary = run_dir / "summary.json"
    if not summary.exists():
        args = ["train", PRESET, *STUDY, layout, *overrides, f"train.out_dir={run_dir}", "--no-progress"]
        code = (PATCH[patch] if patch else "") + f"from looplm.cli import main\nraise SystemExit(main({args!r}))\n"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        print(f"== {experiment} / {variant}", flush=True)
        subprocess.run([sys.executable, "-c", code], check=True, env=env)
    data = json.loads(summary.read_text())
    return {"val_loss": data["val_loss"], "flops": data["model_flops_per_token"], "time": data["wall_time_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/spiral-inv")
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    train_bpe(Path(BPE))
    rows = []
    for name, (question, _, variants, _) in EXPERIMENTS.items():
        if args.only and name not in args.only:
            continue
        results = {v: run(out, name, v) for v in variants}
        rows.append((name, question, results))
        write(rows)


def write(rows) -> None:
    lines = ["# SpiralFormer: controlled runs (investigate.py; read in investigation.md)", "",
             "```", "python docs/results/spiralformer/investigate.py", "```", "",
             "One seed (0) per cell; the study's seed-to-seed std of val loss is ≈ 0.016. Δ = B − T2 under the same "
             "change (the study's seed-0 Δ is +0.095). Val loss is in nats per token of the run's tokenizer, so "
             "the bpe row is not comparable to the others except through Δ.", "",
             "| experiment | change | T2 `1+2R2+1` | B `1+2x{1/8,1/4,1/2,1}+1` | other | Δ (B − T2) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, question, results in rows:
        t2, b = results.get("T2"), results.get("B")
        other = [f"{v}: {r['val_loss']:.4f}" for v, r in results.items() if v not in ("T2", "B")]
        delta = f"{b['val_loss'] - t2['val_loss']:+.4f}" if t2 and b else "–"
        lines.append(f"| {name} | {question} | {t2['val_loss']:.4f} | " if t2 else f"| {name} | {question} | – | ")
        lines[-1] += (f"{b['val_loss']:.4f} | " if b else "– | ") + ("; ".join(other) or "–") + f" | {delta} |"
    (HERE / "investigation-runs.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
