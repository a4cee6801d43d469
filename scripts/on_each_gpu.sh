#!/usr/bin/env bash
# Runs one command per GPU at once (the i-th with CUDA_VISIBLE_DEVICES=i), for single-GPU
# tests and benchmarks on a host of several: each command's output goes to $OUT/gpuI.log (or
# ./on_each_gpu_logs), each is stopped after LIMIT_S seconds (default 540), and the script
# exits non-zero if any command failed. Benchmarks write their reports where their --out says;
# pass a different --out to each.
#
#   bash scripts/on_each_gpu.sh \
#     "python3 benchmarks/bench_moe_layer.py --config qwen3 --out /tmp/r0" \
#     "python3 -m pytest -q tests/ops/fp8"
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "$#" -eq 0 ]; then
  echo "usage: $0 COMMAND [COMMAND ...]   (one per GPU)" >&2
  exit 2
fi
log_dir="${OUT:-on_each_gpu_logs}"
mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1
commands=("$@")
pids=()
for i in "${!commands[@]}"; do
  CUDA_VISIBLE_DEVICES=$i timeout "${LIMIT_S:-540}" bash -c "${commands[$i]}" \
    >"$log_dir/gpu$i.log" 2>&1 &
  pids+=("$!")
done
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  echo "gpu$i rc=$rc: ${commands[$i]}"
  tail -n 2 "$log_dir/gpu$i.log"
  [ "$rc" -eq 0 ] || status=1
done
exit "$status"
