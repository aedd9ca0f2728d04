#!/bin/bash
# The ladder's controlled runs (docs/results/ladder/investigation.md), Dense and Dual UT at seed 0.
# Run from the repository root; each line is one table in this folder.
set -e
export OMP_NUM_THREADS=1
S="looplm study ladder --threads 1"

# 1. The study's earlier default size: operands of 1 to 4 digits, 1500 steps (digits-4/, 3 seeds),
#    then at 3.3x the learning rate and at 3x the steps (digits-4/lr-1e-3/, digits-4/steps-4500/).
L4="data.task.train_length=4 data.task.min_length=1 data.seq_len=15"
$S --out runs/ladder-digits-4 $L4 train.max_steps=1500 train.eval_every=250 train.save_every=500
$S --seeds 1 --variants dense,dual_ut --out runs/ladder-digits-4-lr-1e-3 $L4 \
    train.max_steps=1500 train.eval_every=250 train.save_every=500 train.lr=0.001
$S --seeds 1 --variants dense,dual_ut --out runs/ladder-digits-4-steps-4500 $L4 \
    train.max_steps=4500 train.eval_every=750 train.save_every=1500

# 2. Is it the data or the positions? Every operand at exactly 4 digits (the authors' generator),
#    then also the authors' learned absolute positions instead of rotary (digits-4-fixed/,
#    digits-4-learned-positions/).
F4="data.task.train_length=4 data.task.min_length=4 data.seq_len=15 train.max_steps=1500 train.eval_every=250 train.save_every=500"
$S --seeds 1 --variants dense,dual_ut --out runs/ladder-digits-4-fixed $F4
$S --seeds 1 --variants dense,dual_ut --out runs/ladder-digits-4-learned-positions $F4 model.position=learned

# 3. How many digits does Dense learn in a CPU budget? 3 digits for 4500 and for 1500 steps, then
#    at twice the width and at a constant lr of 1e-3 (digits-3*/); 2 digits is the study's default.
F3="data.task.train_length=3 data.task.min_length=3 data.seq_len=12"
$S --seeds 1 --variants dense --out runs/ladder-digits-3-steps-4500 $F3
$S --seeds 1 --variants dense --out runs/ladder-digits-3 $F3 train.max_steps=1500 train.eval_every=250 train.save_every=500
$S --seeds 1 --variants dense --out runs/ladder-digits-3-d128 $F3 \
    train.max_steps=1500 train.eval_every=250 train.save_every=500 model.d_model=128
$S --seeds 1 --variants dense --out runs/ladder-digits-3-lr-1e-3-constant $F3 \
    train.max_steps=1500 train.eval_every=250 train.save_every=500 train.lr=0.001 train.min_lr_ratio=1

# 4. The halting head's starting bias (-3: p ≈ 0.05, the readout spread over all 12 iterates,
#    instead of UT's 1: p ≈ 0.73, the readout on the first two) at the study's size (halting-bias-3/).
$S --seeds 3 --variants ut_act,dual_ut --out runs/ladder-halting-bias-3 model.halting.init_bias=-3
