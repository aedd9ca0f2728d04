#!/bin/bash
# Is the depth stdlib table's fixed T = 3 row held back by its swept rate?
# (docs/results/depth-stdlib/investigation.md). Run from the repository root; one thread per run.
# Each config is the table's fixed-T3 seed-0 run (runs/study-depth-stdlib/fixed-T3/seed-0) with
# only the fields named changed.
set -e
export OMP_NUM_THREADS=1
dir=docs/results/depth-stdlib/control

# 1. The full budget (400 steps) at 4e-3, the rate fixed T = 2 and every MoR row were swept to.
looplm train $dir/fixed-T3-lr0.004.yaml --resume --no-progress

# 2. The sweep's own run (133 steps) at 4e-3 and 2e-3 with the full runs' 20 warmup steps
#    (train.warmup_steps=20) instead of 5 % of its 133 steps.
for lr in 0.004 0.002; do
  looplm train $dir/fixed-T3-sweep-warmup20-lr$lr.yaml --resume --no-progress
done

for run in fixed-T3-lr0.004 fixed-T3-sweep-warmup20-lr0.004 fixed-T3-sweep-warmup20-lr0.002; do
  python -c "import json; print('$run', json.load(open('runs/depth-control/$run/summary.json'))['val_loss'])"
done
