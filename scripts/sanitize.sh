#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, synccheck and initcheck over every compiled jax_tma
# kernel configuration (scripts/sanitize_cases.py), checking jax_tma's kernels only
# (--kernel-name kns=jax_tma: XLA's own kernels run unchecked). Prints one summary line per
# tool; full reports go to $OUT (or ./sanitize_logs). Needs a Hopper GPU and a built extension
# (bash scripts/gpu_check.sh builds it).
#
#   bash scripts/sanitize.sh                     # all four tools
#   TOOLS="memcheck racecheck" bash scripts/sanitize.sh
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="${OUT:-sanitize_logs}"
mkdir -p "$LOG_DIR"
SANITIZER="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
# XLA's autotuner would launch many candidate kernels under the sanitizer: not ours, only slow.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
status=0
for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
  log="$LOG_DIR/sanitize_$tool.log"
  start=$(date +%s)
  "$SANITIZER" --tool "$tool" --kernel-name kns=jax_tma --print-limit 50 --error-exitcode 3 \
    python3 scripts/sanitize_cases.py >"$log" 2>&1
  rc=$?
  summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -n 1)
  cases=$(grep -E "^[0-9]+ cases, [0-9]+ wrong" "$log" || echo "cases did not finish")
  echo "$tool: ${summary:-no summary} | $cases | rc=$rc | $(( $(date +%s) - start )) s"
  [ "$rc" -eq 0 ] || status=1
done
exit "$status"
