#!/usr/bin/env bash
# The one command a contributor runs on a Hopper GPU machine: builds jax_tma in place against
# the installed jax, runs the whole test suite with the GPU tests required (not skipped), runs
# the demo, and prints a short summary. Logs go to $OUT (or ./gpu_check_logs).
#
#   bash scripts/gpu_check.sh            # everything
#   PYTEST_ARGS="-k kernel" bash scripts/gpu_check.sh
#   SPLIT_GPUS=2 bash scripts/gpu_check.sh   # the suite split over two GPUs
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="${OUT:-gpu_check_logs}"
mkdir -p "$LOG_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

{
  echo "== device"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$LOG_DIR/env.log"

echo "== build"
start=$(date +%s)
if ! "$PY" -m pip install --no-build-isolation --no-deps -v -e . >"$LOG_DIR/build.log" 2>&1; then
  tail -n 60 "$LOG_DIR/build.log"
  echo "SUMMARY: build FAILED"
  exit 1
fi
grep -E "ptxas (warning|error)|spill|C75[01][0-9]" "$LOG_DIR/build.log" || echo "ptxas: no warnings"
echo "build took $(( $(date +%s) - start )) s"

echo "== tests"
export JAX_TMA_REQUIRE_GPU=1 JAX_TMA_REQUIRE_EXTENSION=1
if [ "${SPLIT_GPUS:-1}" = 2 ]; then
  # Two GPUs: the files with GPU tests in two halves of about equal time, one per GPU, then
  # the tests that need both (test_benchmarks and test_packaging have none: CI runs them).
  half_a="tests/ops/gemm/test_gemm.py tests/ops/gemm/test_autotune.py tests/ops/gemm/test_fuzz.py
    tests/ops/ragged/test_ragged_dot.py tests/ops/ragged/test_gated_ragged_dot.py
    tests/ops/ragged/test_gated_ragged_mlp.py tests/ops/moe tests/kernels"
  half_b="tests/ops/dense tests/ops/fp8 tests/ops/gemm/test_dot_general.py
    tests/ops/gemm/test_gemm_sharding.py tests/ops/ragged/test_expert_parallel.py tests/integration"
  CUDA_VISIBLE_DEVICES=0 "$PY" -m pytest -q -rfE -p no:cacheprovider ${PYTEST_ARGS:-} $half_a \
    >"$LOG_DIR/pytest_a.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 "$PY" -m pytest -q -rfE -p no:cacheprovider ${PYTEST_ARGS:-} $half_b \
    >"$LOG_DIR/pytest_b.log" 2>&1 &
  wait -n; rc_1=$?; wait -n; rc_2=$?
  "$PY" -m pytest -q -rfE -p no:cacheprovider tests/ops/gemm/test_gemm_sharding.py -k two_gpus \
    >"$LOG_DIR/pytest_two.log" 2>&1
  rc_3=$?
  tail -n 3 "$LOG_DIR/pytest_a.log" "$LOG_DIR/pytest_b.log" "$LOG_DIR/pytest_two.log"
  cat "$LOG_DIR"/pytest_*.log >"$LOG_DIR/pytest.log"
  test_rc=$(( rc_1 | rc_2 | rc_3 ))
else
  "$PY" -m pytest -q -rfE ${PYTEST_ARGS:-} tests 2>&1 | tee "$LOG_DIR/pytest.log"
  test_rc=${PIPESTATUS[0]}
fi

echo "== demo"
"$PY" -m jax_tma 2>&1 | tee "$LOG_DIR/demo.log"
demo_rc=${PIPESTATUS[0]}

echo "== summary"
grep -E "^[0-9]+ (passed|failed)|passed|failed" "$LOG_DIR/pytest.log" | tail -n 1
grep -E "^(device|path|check|jax_tma.matmul|XLA dot|speed)" "$LOG_DIR/demo.log"
if [ "$test_rc" -ne 0 ] || [ "$demo_rc" -ne 0 ]; then
  echo "SUMMARY: FAILED (pytest rc=$test_rc, demo rc=$demo_rc)"
  exit 1
fi
echo "SUMMARY: OK"
