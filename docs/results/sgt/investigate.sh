#!/bin/bash
# The SGT study's controlled re-run (docs/results/sgt/investigation.md): vanilla and SGT K = 2
# at 3x the training horizon (2400 steps; growth still from step 100 every 50), seed 0.
# Run from the repository root; about 40 CPU-minutes on one thread of a 2-core EPYC.
set -e
OMP_NUM_THREADS=1 looplm study sgt --seeds 1 --threads 1 --variants vanilla,sgt-k2 --out runs/sgt-steps-2400 \
    train.max_steps=2400 train.eval_every=300 train.save_every=1200
