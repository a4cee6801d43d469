#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, synccheck and initcheck over every compiled jax_tma
# kernel configuration (scripts/sanitize_cases.py), checking jax_tma's kernels only
# (--kernel-name kns=jax_tma: XLA's own kernels run unchecked), each case family (gemm, dense,
# ragged, fp8) in a process of its own. Prints one summary line per tool; full reports go to
# $OUT (or ./sanitize_logs), one log per tool and family. Needs a Hopper GPU and a built
# extension (bash scripts/gpu_check.sh builds it).
#
# Before a tool's clean report on the cases counts, the same tool with the same filter must
# report the seeded fault of csrc/testing/sanitizer_seed.cu (a kernel of the jax_tma
# namespace) and nothing on its clean run: a filter that matched no kernel, or a tool that
# instrumented nothing, would otherwise pass silently.
#
# initcheck runs the cases without the filter and without host-API checks: a kernel it does not
# instrument leaves what it writes marked uninitialised, so filtered, every buffer XLA's own
# kernels wrote (the NaN poison, padded operands) read as uninitialised to our kernels and to
# XLA's copies, thousands of false reports. Unfiltered, only reports inside jax_tma kernels count.
#
# XLA allocates every buffer by itself (XLA_PYTHON_CLIENT_ALLOCATOR=platform, no
# preallocation): with its default pool, one cudaMalloc of most of the GPU, memcheck could not
# see a read past one buffer into its neighbour, and initcheck tracked the whole pool (slow).
#
#   bash scripts/sanitize.sh                     # all four tools
#   TOOLS="memcheck racecheck" bash scripts/sanitize.sh
#   PRINT_LIMIT=1000 TOOLS=racecheck bash scripts/sanitize.sh   # every report, not the first 50
#   ONLY=dense,ragged TOOLS=racecheck bash scripts/sanitize.sh  # some case families only
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="${OUT:-sanitize_logs}"
mkdir -p "$LOG_DIR"
SANITIZER="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
PY="${PYTHON:-python3}"
# XLA's autotuner would launch many candidate kernels under the sanitizer: not ours, only slow.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
export XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false
FILTER=(--kernel-name kns=jax_tma)
FAMILIES="${ONLY:-$("$PY" scripts/sanitize_cases.py --families)}"
if [ -z "$FAMILIES" ]; then
  echo "SUMMARY: no case families (scripts/sanitize_cases.py --families printed none)"
  exit 1
fi

seed="$LOG_DIR/sanitizer_seed"
if ! "$("$PY" tools/find_nvcc.py)" -std=c++17 -arch=sm_90a -O2 -lineinfo \
    -o "$seed" csrc/testing/sanitizer_seed.cu >"$LOG_DIR/sanitizer_seed_build.log" 2>&1; then
  cat "$LOG_DIR/sanitizer_seed_build.log"
  echo "SUMMARY: the seeded-fault program does not build"
  exit 1
fi

errors() {  # the count of compute-sanitizer's summary line in log $1 ("" when none)
  grep -E "(ERROR|RACECHECK) SUMMARY" "$1" | tail -n 1 | grep -oE "[0-9]+ (error|hazard)" |
    head -n 1 | grep -oE "^[0-9]+"
}

status=0
for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
  # 1. The tool sees the seeded fault (and nothing in the clean run) through the filter.
  seed_log="$LOG_DIR/seed_$tool.log"
  timeout 120 "$SANITIZER" --tool "$tool" "${FILTER[@]}" "$seed" "$tool" >"$seed_log" 2>&1
  seeded=$(errors "$seed_log")
  timeout 120 "$SANITIZER" --tool "$tool" "${FILTER[@]}" "$seed" clean >"$seed_log.clean" 2>&1
  clean=$(errors "$seed_log.clean")
  cat "$seed_log.clean" >>"$seed_log" && rm -f "$seed_log.clean"
  if [ "${seeded:-0}" -gt 0 ] && [ "${clean:-x}" = "0" ]; then
    self="seeded fault found (${seeded}), clean run 0"
  else
    self="SELF-CHECK FAILED: seeded ${seeded:-no summary}, clean ${clean:-no summary}"
    status=1
  fi
  # 2. The cases, one process per case family. Under synccheck, one process running all 165
  # cases (one jitted function) once ended in a segmentation fault with no report (H100,
  # compute-sanitizer of CUDA 13.0; two later runs of it were clean): a crash now costs one
  # family's report, named below, not the tool's. (About 3x the time: each process compiles
  # and loads on its own.)
  start=$(date +%s)
  rc=0 reported=0 cases=0 wrong=0 ours=0 unfinished=""
  for family in ${FAMILIES//,/ }; do
    log="$LOG_DIR/sanitize_${tool}_$family.log"
    if [ "$tool" = initcheck ]; then
      "$SANITIZER" --tool initcheck --check-api-memory-access no --print-limit 10000 \
        "$PY" scripts/sanitize_cases.py --only "$family" >"$log" 2>&1 || rc=$?
      ours=$((ours + $(grep -A1 -E "^========= Uninitialized" "$log" | grep -cE "^=+ +at .*jax_tma")))
    else
      "$SANITIZER" --tool "$tool" "${FILTER[@]}" --print-limit "${PRINT_LIMIT:-50}" \
        --error-exitcode 3 "$PY" scripts/sanitize_cases.py --only "$family" >"$log" 2>&1 || rc=$?
    fi
    count=$(errors "$log")
    line=$(grep -E "^[0-9]+ cases, [0-9]+ wrong" "$log")
    if [ -z "$count" ] || [ -z "$line" ]; then
      unfinished="$unfinished $family"
    else
      read -r n _ w _ <<<"$line"
      reported=$((reported + count)) cases=$((cases + n)) wrong=$((wrong + w))
    fi
  done
  if [ "$tool" = initcheck ]; then
    [ "$ours" -eq 0 ] || rc=3
    self="$self | in jax_tma kernels: $ours"
  fi
  [ -z "$unfinished" ] || [ "$rc" -ne 0 ] || rc=1
  unit=$([ "$tool" = racecheck ] && echo hazards || echo errors)
  echo "$tool: $reported $unit reported | $cases cases, $wrong wrong${unfinished:+ | did not finish:$unfinished} | rc=$rc | $(( $(date +%s) - start )) s | $self"
  [ "$rc" -eq 0 ] || status=1
done
exit "$status"
