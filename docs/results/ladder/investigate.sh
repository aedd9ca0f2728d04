#!/bin/bash
# The ladder's controlled re-runs (docs/results/ladder/investigation.md): Dense and Dual UT,
# seed 0, at 3x the paper's learning rate and at 3x the steps. Run from the repository root.
set -e
export OMP_NUM_THREADS=1
looplm study ladder --seeds 1 --threads 1 --variants dense,dual_ut --out runs/ladder-lr-1e-3 train.lr=0.001
looplm study ladder --seeds 1 --threads 1 --variants dense,dual_ut --out runs/ladder-steps-4500 \
    train.max_steps=4500 train.eval_every=750 train.save_every=1500
