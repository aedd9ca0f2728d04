#!/bin/bash
# Why looping does not lower the loss in the lt2 study (docs/results/lt2/investigation.md).
# Run from the repository root; one thread per run.
set -e
export OMP_NUM_THREADS=1

# 1. Training horizon: the attention pair (LM and state tracking) at 1500 steps instead of 300, seed 0.
looplm study lt2 --seeds 1 --threads 1 --variants attention,attention-looped --out runs/lt2-steps-1500 \
    train.max_steps=1500 train.eval_every=150 train.save_every=750

# 2. LT2 §4.4's SDPA output gate (model.mixer.output_gate) on the attention pair, LM part, 3 seeds,
#    everything else as in the study's default size.
COMMON="data.source=pydoc data.tokenizer=byte data.seq_len=64 data.val_batches=8 train.batch_size=16
        train.lr=0.002 train.warmup_fraction=0.05 train.max_steps=300 train.eval_every=37 train.save_every=0
        train.log_every=50 train.sample_tokens=0 train.device=cpu model.d_model=64 model.hybrid=null"
for seed in 0 1 2; do
  for variant in attention:5:base attention-looped:5R2:gated_residual; do
    IFS=: read -r name layout topology <<< "$variant"
    looplm train tiny-lt2-transformer $COMMON "model.mixer={kind: attention, output_gate: true}" \
        model.layout="$layout" "model.topology={kind: $topology}" train.seed=$seed data.seed=$seed \
        train.out_dir=runs/lt2-gate/$name/seed-$seed --no-progress
    python -c "import json; print('$name', $seed, json.load(open('runs/lt2-gate/$name/seed-$seed/summary.json'))['val_loss'])"
  done
done

# 3. State tracking at a longer horizon: the attention pair on the state task alone, seed 0, 4000
#    steps (13x the study's 300), the study's default-size task settings otherwise.
for variant in attention-looped:5R2:gated_residual attention:5:base; do
  IFS=: read -r name layout topology <<< "$variant"
  looplm train task-state-tracking "model.mixer={kind: attention}" model.hybrid=null \
    model.layout="$layout" "model.topology={kind: $topology}" "data.task.curriculum=[5, 8]" data.seq_len=176 \
    model.max_seq_len=184 model.d_model=64 train.batch_size=8 train.lr=1e-3 train.max_steps=4000 \
    train.eval_every=250 train.save_every=500 train.keep_last=1 train.log_every=250 train.sample_tokens=0 \
    train.device=cpu train.threads=1 data.task.eval_samples=32 train.out_dir=runs/lt2-state-4000/$name --no-progress
done
