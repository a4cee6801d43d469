#!/usr/bin/env bash
# The one command a contributor runs on a Hopper GPU machine: builds jax_tma in place against
# the installed jax, runs the whole test suite with the GPU tests required (not skipped), runs
# the demo, and prints a short summary. Logs go to $OUT (or ./gpu_check_logs).
#
#   bash scripts/gpu_check.sh            # everything
#   PYTEST_ARGS="-k kernel" bash scripts/gpu_check.sh
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
JAX_TMA_REQUIRE_GPU=1 JAX_TMA_REQUIRE_EXTENSION=1 "$PY" -m pytest -q -rfE ${PYTEST_ARGS:-} tests \
  2>&1 | tee "$LOG_DIR/pytest.log"
test_rc=${PIPESTATUS[0]}

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
