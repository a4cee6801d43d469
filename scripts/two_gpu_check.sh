#!/usr/bin/env bash
# On a host with two (or more) Hopper GPUs: builds jax_tma in place, runs the multi-GPU tests
# (an M- and a K-sharded product on the kernel, matching one GPU; the expert-parallel layer and
# shard_map tests, matching one GPU, those of 4 devices where 4 are present), the Flax example with
# data-parallel batches, and every op's sharded speedups (benchmarks/bench_sharded.py, on 1 to
# all GPUs present). Logs go to $OUT (or ./gpu_check_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="${OUT:-gpu_check_logs}"
mkdir -p "$LOG_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
status=0

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$LOG_DIR/env2.log"
if ! "$PY" -m pip install --no-build-isolation --no-deps -e . >"$LOG_DIR/build2.log" 2>&1; then
  tail -n 40 "$LOG_DIR/build2.log"; echo "SUMMARY: build FAILED"; exit 1
fi

echo "== multi-GPU tests"
JAX_TMA_REQUIRE_GPU=1 "$PY" -m pytest -q -rfE tests/ops/gemm/test_gemm_sharding.py -k two_gpus 2>&1 \
  | tee "$LOG_DIR/pytest2.log" || status=1
grep -q " passed" "$LOG_DIR/pytest2.log" && ! grep -q "skipped" "$LOG_DIR/pytest2.log" || status=1
# Expert parallelism over the GPUs (the 4-device tests skip on fewer) and on the CPU mesh.
JAX_TMA_REQUIRE_GPU=1 "$PY" -m pytest -q -rfE tests/ops/ragged/test_expert_parallel.py \
  tests/ops/moe/test_moe.py -k "expert_parallel or gpu" 2>&1 | tee "$LOG_DIR/pytest_ep.log" || status=1

echo "== Flax example, data parallel over every GPU"
"$PY" examples/flax_mlp.py --devices "$("$PY" -c 'import jax; print(jax.device_count())')" \
  2>&1 | tee "$LOG_DIR/flax_dp.log" || status=1

echo "== sharded speedups"
"$PY" benchmarks/bench_sharded.py ${BENCH_ARGS:-} 2>&1 | tee "$LOG_DIR/bench_sharded.log" || status=1
cp -r benchmarks/results "$LOG_DIR/" 2>/dev/null || true

[ "$status" -eq 0 ] && echo "SUMMARY: OK" || echo "SUMMARY: FAILED"
exit "$status"
