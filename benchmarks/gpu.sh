#!/usr/bin/env bash
# One GPU run of looplm's device checks and benchmarks (issues 25 and 30), under 8 minutes on
# one H100 or H200, each part under its own deadline, issue 25's training targets first (the
# open ones; issue 30's decoding figures are committed and rerun last, as regressions):
#
#   1. the GPU tests (tests/gpu, CUDA cases only, -v so that a cut run still names what passed;
#      in parallel processes when pytest-xdist is there, since Triton compiling dominates);
#   1b. benchmarks/fla_check.py: fla's gated backward against the PyTorch ops per gated kind
#      (GDN first), at 128-wide tiles where fla refuses it (issue 25's Hopper path);
#   2. benchmarks/train_throughput.py --device cuda --dtype bf16 at the issue's size (d = 1024,
#      1024 tokens, batch 8), eager, one target's variants at a time (loop efficiency, then
#      SpiralFormer, SGT and GDN; the report rewritten after each), profiled;
#   2b. the same, dense alone at d = 2048, eager and compiled (the compiled-MFU target);
#   2c. benchmarks/kernels.py: MeSH's and SpiralFormer's Triton kernels under a grid of launch
#      configurations, GB/s beside a device copy;
#   3. benchmarks/ladder_speed.py: the paper-size ladder's training step per rung, compiled
#      with reduce-overhead (CUDA graphs);
#   4. benchmarks/launches.py --device cuda: GPU kernels and launch calls per decoded token
#      per block pass, profiled (the CPU-counted decode targets of issue 30 beside them);
#   5. benchmarks/generate.py: batch 1 and 8 greedy generation, looplm vs transformers' LLaMA;
#   6. benchmarks/long_context.py: the paper's lt2-0.6b shape at contexts 2048 and 8192,
#      batch 8, with --compile cuda-graph, decode timed through model.generate.
#
# Each part writes benchmarks/results/*-cuda.md (long_context and generate rewrite theirs
# after every cell, so a part stopped at its deadline keeps what it measured), and this
# script writes benchmarks/results/gpu-cuda.md: the card, each part's command, status and
# time. A failed or timed-out part does not stop the later ones; the exit status is 1 if
# any part failed, else 0. Nothing is installed from the network: wheels found in .whl/
# (flash-linear-attention and fla-core, carried to the machine; see
# benchmarks/results/gpu-check.md) are installed offline into a temporary folder.
#
#   bash benchmarks/gpu.sh             # from anywhere; runs in the repository root
#   bash benchmarks/gpu.sh --dry-run   # print each part's deadline and command, run nothing
#
# PYTHON (default python3) picks the interpreter; GPU_SH_BUDGET (default 470 s) the whole
# run's deadline, which caps every part's own. A fresh machine spends most of each part
# compiling Triton kernels (the first run, 2026-11-26, cut every part at its deadline):
# GPU_SH_TRITON_CACHE=FILE.tgz unpacks a Triton cache saved from an earlier run of the same
# card and Triton version, and GPU_SH_SAVE_CACHE=FILE.tgz saves this run's.
set -u

cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
BUDGET=${GPU_SH_BUDGET:-470}
RESULTS=benchmarks/results
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu.sh [--dry-run]" >&2; exit 2 ;;
esac

START=$SECONDS
FAILED=0
ROWS=()

elapsed() { echo "+$((SECONDS - START))s"; }

# part NAME SECONDS COMMAND...: run COMMAND under min(SECONDS, what is left of BUDGET);
# LABEL, when set, is how the command is shown.
part() {
  local name=$1 limit=$2
  shift 2
  local shown=${LABEL:-$*}
  local left=$((BUDGET - (SECONDS - START)))
  ((limit > left)) && limit=$left
  if ((DRY)); then
    echo "PART $name ${limit}s: $shown"
    return 0
  fi
  if ((limit < 10)); then
    echo "[gpu.sh $(elapsed)] $name: skipped, the run's ${BUDGET}s are spent"
    ROWS+=("| $name | skipped: no time left | - | \`$shown\` |")
    FAILED=1
    return 0
  fi
  echo "[gpu.sh $(elapsed)] $name: start, deadline ${limit}s: $shown"
  local t0=$SECONDS status rc
  timeout -k 10 "$limit" "$@"
  rc=$?
  case $rc in
    0) status="passed" ;;
    124 | 137) status="timed out at ${limit}s"; FAILED=1 ;;
    *) status="failed (exit $rc)"; FAILED=1 ;;
  esac
  echo "[gpu.sh $(elapsed)] $name: $status after $((SECONDS - t0))s"
  ROWS+=("| $name | $status | $((SECONDS - t0)) | \`$shown\` |")
}

if ((!DRY)); then
  if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d /tmp/looplm-site.XXXX)
    echo "[gpu.sh $(elapsed)] installing $(ls .whl/*.whl | wc -l) carried wheels offline into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
      && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" \
      || echo "[gpu.sh] wheel install failed: the linear mixers run looplm's PyTorch ops"
  fi
  export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d /tmp/looplm-triton.XXXX)}
  if [[ -n ${GPU_SH_TRITON_CACHE:-} && -f $GPU_SH_TRITON_CACHE ]]; then
    tar xzf "$GPU_SH_TRITON_CACHE" -C "$TRITON_CACHE_DIR" --strip-components=1 \
      && echo "[gpu.sh $(elapsed)] Triton cache seeded from $GPU_SH_TRITON_CACHE"
  fi
  export PYTHONUNBUFFERED=1
  mkdir -p "$RESULTS"
  CARD=$("$PY" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" 2>&1 | tail -1)
  VERSIONS=$("$PY" -c "
import importlib.metadata as m, torch
def v(name):
    try: return m.version(name)
    except m.PackageNotFoundError: return 'absent'
print(f'torch {torch.__version__}, triton {v(\"triton\")}, transformers {v(\"transformers\")}, '
      f'flash-linear-attention {v(\"flash-linear-attention\")}')" 2>&1 | tail -1)
  echo "[gpu.sh $(elapsed)] card: $CARD; $VERSIONS"
  if [[ $CARD == "no CUDA device" ]]; then
    echo "[gpu.sh] no CUDA device here: nothing to run (--dry-run lists the parts)" >&2
    exit 1
  fi
fi

# 1. GPU tests: CUDA cases only (the CPU ones run in CI), a deadline per test where
# pytest-timeout is installed, several processes where pytest-xdist is.
TEST_ARGS=(-v -p no:cacheprovider -k "not cpu")
TEST_FILES=(tests/gpu tests/ops/test_selected_triton.py tests/topology/test_mesh_triton.py
            tests/resolution/test_resolution_triton.py
            tests/mixers/test_attention.py::test_grouped_heads_read_in_place_equal_the_repeated_heads)
if ((!DRY)); then
  "$PY" -c "import pytest_timeout" 2>/dev/null && TEST_ARGS+=(--timeout 60)
  # pyproject's addopts ask for pytest-xdist (one worker per core, a file per worker): here 8
  # workers share the tests one by one, or, without xdist, addopts without its options
  if "$PY" -c "import xdist" 2>/dev/null; then TEST_ARGS+=(-n 8 --dist load)
  else TEST_ARGS+=(-o "addopts=-ra -m 'not bf16_on_cpu'"); fi
fi
TEST_LOG=$RESULTS/.gpu-tests.log
LABEL="$PY -m pytest ${TEST_FILES[*]} ${TEST_ARGS[*]}" part "GPU tests" 60 bash -c 'set -o pipefail; "$0" -m pytest "${@:2}" 2>&1 | tee "$1"' "$PY" "$TEST_LOG" "${TEST_FILES[@]}" "${TEST_ARGS[@]}"
if ((!DRY)) && [[ -f $TEST_LOG ]]; then
  {
    echo "# GPU tests (${TEST_FILES[*]}, CUDA cases)"
    echo
    echo "Card: $CARD; $VERSIONS.  "
    echo "Command: \`$PY -m pytest ${TEST_FILES[*]} ${TEST_ARGS[*]}\` (run by benchmarks/gpu.sh, deadline 60 s)."
    echo
    echo '```'
    grep -E "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS|Timeout|^(E  |FAILED|ERROR)|passed|failed" "$TEST_LOG" | tail -150
    echo '```'
  } >"$RESULTS/gpu-tests-cuda.md"
  rm -f "$TEST_LOG"
fi

# 1b. fla's gated backward checked against the PyTorch ops (GDN first; a row per kind as it ends).
part "fla check" 20 "$PY" benchmarks/fla_check.py --out "$RESULTS/fla-check-cuda.md"

# 2. Training throughput, bf16 autocast, at issue 25's size: each target's variants side by side,
# the report rewritten after each group (a cut keeps the targets it finished); then dense alone
# at d = 2048, eager and compiled, for the compiled-MFU target.
TRAIN=(benchmarks/train_throughput.py --device cuda --dtype bf16 --seq 1024 --batch 8 --steps 2 --repeats 3 --warmup 2)
part "train throughput" 150 "$PY" "${TRAIN[@]}" --width 1024 --no-compile --profile dense mesh spiral sgt gdn \
  --out "$RESULTS/train-throughput-cuda.md"
part "train throughput, dense d=2048, compiled" 60 "$PY" "${TRAIN[@]}" --width 2048 --variants dense --compile \
  --out "$RESULTS/train-throughput-2048-cuda.md"

# 2c. MeSH's and SpiralFormer's Triton kernels under other launch configurations, timed side by
# side against a device copy (what to change if their variants above fall short).
part "kernels" 30 "$PY" benchmarks/kernels.py --device cuda --out "$RESULTS/kernels-cuda.md"

# 3. The paper-size ladder's step per rung under train.compile=reduce-overhead (issue 25: a
# rung's 5000 steps in under 2 minutes); dense and the adaptive UT+ACT first, a row each.
part "ladder speed" 45 "$PY" benchmarks/ladder_speed.py --device cuda --compile reduce-overhead \
  --rungs dense ut_act ar_trm --out "$RESULTS/ladder-speed-cuda.md"

# 4. What a decoded token launches on the GPU (profiled kernels and launch calls per block
# pass; the CPU-counted targets of issue 30 beside them).
part "launches" 25 "$PY" benchmarks/launches.py --device cuda --dtype bf16 --out "$RESULTS/launches-cuda.md"

# 5. Generation against transformers' LLaMA (batch 1 and 8, five systems; rewritten per cell).
part "generate" 35 "$PY" benchmarks/generate.py --device cuda --new-tokens 64 --repeats 3 --warmup 2 \
  --out "$RESULTS/generate-cuda.md"

# 6. Long context at the paper's LT2 0.6B shape (100 block passes per token), the eager step
# recorded as CUDA graphs, every model alike (the eager run of 2026-11-26 is in
# long-context-lt2-0.6b-cuda.md; torch.compile of the 100-pass step does not finish inside a
# part's deadline: long_context.py --compile runs it by hand). Rewritten after every cell.
LONG=(benchmarks/long_context.py --device cuda --contexts 2048 8192 --batch 8 --new 16 --decode-via generate)
part "long context, lt2-0.6b, CUDA graph" 45 "$PY" "${LONG[@]}" --shape lt2-0.6b --compile cuda-graph \
  --out "$RESULTS/long-context-lt2-0.6b-cuda-graph-cuda.md"

if ((DRY)); then
  exit 0
fi
{
  echo "# GPU run: benchmarks/gpu.sh"
  echo
  echo "Card: $CARD; $VERSIONS; finished $(date -u '+%Y-%m-%d %H:%M UTC') after $((SECONDS - START)) s"
  echo "(budget ${BUDGET} s). Each part's results are in the file its command names."
  echo
  echo "| part | status | seconds | command |"
  echo "| --- | --- | ---: | --- |"
  printf '%s\n' "${ROWS[@]}"
} >"$RESULTS/gpu-cuda.md"
if [[ -n ${GPU_SH_SAVE_CACHE:-} ]]; then
  tar czf "$GPU_SH_SAVE_CACHE" -C "$(dirname "$TRITON_CACHE_DIR")" "$(basename "$TRITON_CACHE_DIR")" \
    && echo "[gpu.sh $(elapsed)] Triton cache saved to $GPU_SH_SAVE_CACHE"
fi
echo "[gpu.sh $(elapsed)] done; $([[ $FAILED == 0 ]] && echo "every part passed" || echo "some part failed"): $RESULTS/gpu-cuda.md"
exit $FAILED
