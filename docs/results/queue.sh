#!/bin/bash
# The studies whose tables are still to come (issues 27 and 28), in the order they land, as
# two lanes of one thread each for a 2-core machine. Run from the repository root:
#
#   nohup bash docs/results/queue.sh a > runs/queue-a.log 2>&1 &
#   nohup bash docs/results/queue.sh b > runs/queue-b.log 2>&1 &
#   bash docs/results/queue.sh stage    # before the machine goes: git add the finished runs' records
#
# Every study trains into its docs/results directory. A lane stopped anywhere restarts with the
# same command on any machine: a finished run whose records (metrics.jsonl, summary.json,
# study.json) are committed is read back; .gitignore keeps the checkpoints out, so an
# unfinished run starts over. `stage` adds the records of finished runs only
# (`looplm.study.runs.finished_records`, as docs/results/ladder-paper.sh packs them: a study run
# also needs its measures, study.json; a sweep run does not); commit them with the tables.
# The distillation study's rows start from the seed's teacher (and stage 1) checkpoints, which a
# record does not carry: a row that finds them gone trains them again from their records first
# (looplm.study.distillation, checked against the recorded losses).
# Runs two tables share are read through links (link_targets, below): `stage` adds their
# records where they are, in the directory of the table that trained them.
set -u
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
# 2 MB pages for PyTorch's large CPU allocations (the logits): the same numbers, faster steps
# (benchmarks/cpu_step.py)
export THP_MEM_ALLOC_ENABLE=1
study() { looplm study "$@" --threads 1 --no-progress; }
STATE=${QUEUE_STATE:-runs/queue}  # where each lane says its half of a split table is done
mkdir -p "$STATE"

# The longest tables are split between the lanes, a half of the rows each (every comparison
# within one half: the seed extension of a half needs only its own rows). The lane that
# finishes its half second reads every row back and writes the table (mkdir: one lane only,
# if both finish at once); neither waits for the other.
half() {  # half TABLE THIS OTHER VARIANTS STUDY_ARGS...: this lane's half THIS of TABLE
  local table=$1 this=$2 other=$3 variants=$4
  shift 4
  study "$@" --variants "$variants" || return 0
  touch "$STATE/$table-$this.done"
  if [ -e "$STATE/$table-$other.done" ] && mkdir "$STATE/$table-table" 2>/dev/null; then
    study "$@" || rmdir "$STATE/$table-table"  # failed: the next restart tries again
  fi
}
DEPTH=(depth --size stdlib --out docs/results/depth-stdlib)
LT2=(lt2 --size stdlib --out docs/results/lt2-stdlib)
# A run two tables share is trained once, in the first table's directory, and committed as a
# link from the other's: the ladder bias sweep's rows at each rung's default bias are the
# ladder table's runs of those rungs (ladder-bias-sweep/RUNG -> ../ladder/RUNG), SpiralFormer's
# T = 2 loop is MeSH's mesh row, its sweep runs included (spiralformer-stdlib/looped-T2 ->
# ../mesh-stdlib/mesh; lr-sweep/lr-RATE/looped-T2 -> …/mesh-stdlib/lr-sweep/lr-RATE/mesh): the
# same configs (tests/study/test_queue.py), each table with its own measures (study.json).
# A study trains through a link only once its target exists: the table it points into runs
# first in the same lane, and link_targets creates the targets inside the folders it made.
link_targets() {  # link_targets DIR: the folders DIR's links point to, where their parent exists
  local link target
  while IFS= read -r link; do
    target="$(dirname "$link")/$(readlink "$link")"
    if [ -d "$(dirname "$target")" ]; then mkdir -p "$target"; fi
  done < <(find "$1" -type l 2>/dev/null)
}

case "${1:-}" in
  a)
    half depth fixed-mor huginn fixed-T3,fixed-T2,mor-expert,mor-expert-topk,mor-expert-shared,mor-token "${DEPTH[@]}"
    half lt2 attention-gdn hybrid attention,attention-looped,attention-looped-gated,gdn,gdn-looped "${LT2[@]}"
    study ladder --seeds 5 --out docs/results/ladder
    link_targets docs/results/ladder-bias-sweep
    study ladder --size bias-sweep --out docs/results/ladder-bias-sweep
    # moved from lane b (≈ 5 h): lane b's four studies after LT2 ran ≈ 20 h against lane a's ≈ 13
    study sgt --size stdlib --out docs/results/sgt-stdlib
    ;;
  b)
    half depth huginn fixed-mor huginn-fixed-T3,huginn-fixed-T4-k2,huginn-r4-k2 "${DEPTH[@]}"
    # the Full+GDN pair: ≈ a third of LT2's steps, so that lane a, with both ladder tables
    # after LT2, does not finish hours after lane b
    half lt2 hybrid attention-gdn full+gdn,full+gdn-looped "${LT2[@]}"
    study mesh --size stdlib --out docs/results/mesh-stdlib
    link_targets docs/results/spiralformer-stdlib
    study spiralformer --size stdlib --out docs/results/spiralformer-stdlib
    study distill --out docs/results/distill
    ;;
  stage)
    python - <<'EOF'
import subprocess
from pathlib import Path

from looplm.study.runs import finished_records

files = finished_records(Path("docs/results"))
if files:
    subprocess.run(["git", "add", "--", *map(str, files)], check=True)
print(f"staged {len(files)} files of finished runs" if files else "no finished run to stage")
EOF
    ;;
  *)
    echo "usage: bash docs/results/queue.sh a|b|stage" >&2
    exit 2
    ;;
esac
