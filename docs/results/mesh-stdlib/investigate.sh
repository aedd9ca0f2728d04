#!/bin/bash
# Is mesh's deficit in the MeSH stdlib table a matter of budget? (docs/results/mesh-stdlib/
# investigation.md). Run from the repository root; one thread per run. Each config is the
# table's seed-0 run of its row (docs/results/mesh-stdlib/<row>/seed-0, summary.json's config)
# with only max_steps (400 -> 1200: 4.9 M of the 8.2 M training tokens, still read once; the
# schedule's 5 % warmup and cosine decay stretch with it) and the eval/save cadence (100) changed.
set -e
export OMP_NUM_THREADS=1 THP_MEM_ALLOC_ENABLE=1
dir=docs/results/mesh-stdlib/control

for run in mesh-steps1200 base-steps1200; do
  looplm train $dir/$run.yaml --resume --no-progress &
done
wait

for run in mesh-steps1200 base-steps1200; do
  python -c "import json; print('$run', json.load(open('runs/mesh-control/$run/summary.json'))['val_loss'])"
done
