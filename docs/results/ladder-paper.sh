#!/bin/bash
# The compute-placement ladder at the paper's size on one GPU (issue 28:
# docs/results/ladder-paper/), one seed, rung by rung under a deadline, so that a device
# call of a few minutes adds what it can and the next call goes on:
#
#   bash docs/results/ladder-paper.sh          # on the device: $OUT/ladder-paper.tgz holds
#                                              # the finished rungs' records (no $OUT: the
#                                              # runs stay in docs/results/ladder-paper)
#   tar xzf FILES_AT/ladder-paper.tgz          # here, in the repository root; commit them
#
# A rung whose records are in docs/results/ladder-paper (committed: they travel with the
# working tree) is read back, not trained; a rung cut at the deadline starts over next time
# (its checkpoints, about 0.5 GB with the optimiser state, cannot come back). Once every
# rung is recorded, the same study command writes the table here, on a CPU: it reads every
# run back (`looplm study ladder --paper --seeds 1 --out docs/results/ladder-paper
# train.device=cuda`, the arguments the runs were trained with).
#
# LADDER_PAPER_BUDGET (default 540 s) caps the whole run, and a rung starts only while
# LADDER_PAPER_RUNG (default 150 s) are left; LADDER_PAPER_RUNGS picks rungs (default all, in
# the ladder's order); LADDER_PAPER_ARGS replaces the size and the shared overrides (default
# `--paper train.device=cuda`; the tests run `--quick train.device=cpu`); LADDER_PAPER_DIR the
# study's directory; PYTHON the interpreter.
set -u
cd "$(dirname "$0")/../.." || exit 1
PY=${PYTHON:-python3}
BUDGET=${LADDER_PAPER_BUDGET:-540}
RUNG=${LADDER_PAPER_RUNG:-150}
DIR=${LADDER_PAPER_DIR:-docs/results/ladder-paper}
read -r -a ARGS <<< "${LADDER_PAPER_ARGS:---paper train.device=cuda}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS
RUNGS=${LADDER_PAPER_RUNGS:-$($PY -c "from looplm.ladder.rungs import RUNGS; print(*RUNGS)")}

for rung in $RUNGS; do
  left=$((BUDGET - (SECONDS - START)))
  if ((left < RUNG)); then
    echo "[ladder-paper +$((SECONDS - START))s] $rung: not started, ${left}s left of ${BUDGET}s"
    continue
  fi
  echo "[ladder-paper +$((SECONDS - START))s] $rung: deadline ${left}s"
  timeout -k 10 "$left" "$PY" -m looplm study ladder "${ARGS[@]}" --seeds 1 --variants "$rung" --out "$DIR" \
    --no-progress || echo "[ladder-paper +$((SECONDS - START))s] $rung: stopped (status $?)"
done

# the records of every finished run (what the study reads back), as one file for the device
# to hand back; on a machine of one's own they are where the study reads them already
if [[ -z ${OUT:-} ]]; then
  echo "[ladder-paper] the runs are in $DIR (no \$OUT: nothing packed)"
  exit 0
fi
mkdir -p "$OUT"
"$PY" - "$DIR" "$OUT/ladder-paper.tgz" <<'PYEOF'
import sys
import tarfile

from looplm.study.runs import finished_records

records = finished_records(sys.argv[1])
with tarfile.open(sys.argv[2], "w:gz") as tar:
    for path in records:
        tar.add(path)
runs = sum(path.name == "summary.json" for path in records)
print(f"[ladder-paper] the records of {runs} finished run{'' if runs == 1 else 's'} in {sys.argv[2]}")
PYEOF
