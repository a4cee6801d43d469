#!/usr/bin/env bash
# FP8 on a Hopper GPU (issue 29): builds jax_tma in place against the installed jax, runs the
# FP8 GPU tests (every compiled tile and type against float64, the K = 8192 bound and the
# promotion test, edge shapes, determinism, gradients), the SASS checks of the extension (FP8
# kernels: QGMMA, no local memory), the FP8 benchmark suite, which writes
# benchmarks/results/<device>/bench_fp8.*, and a sweep of the compiled tiles on four shapes.
# Logs and results go to $OUT (or ./fp8_check_logs). About 8 minutes on an H100 with a warm
# build directory (the kernels compile in ~3 minutes on 16 cores).
#
#   bash scripts/fp8_check.sh
#   BENCH_ARGS="--quick" bash scripts/fp8_check.sh     # two benchmark shapes only
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="${OUT:-fp8_check_logs}"
mkdir -p "$LOG_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
status=0

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  git log -1 --oneline 2>/dev/null || true
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

echo "== FP8 tests (GPU required)"
JAX_TMA_REQUIRE_GPU=1 JAX_TMA_REQUIRE_EXTENSION=1 timeout 1200 "$PY" -m pytest -q -rfE -s \
  tests/ops/fp8/test_fp8.py tests/ops/fp8/test_fp8_ragged_dot.py tests/kernels/test_sass.py 2>&1 \
  | tee "$LOG_DIR/pytest_fp8.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
grep -E "K=8192 relative error" "$LOG_DIR/pytest_fp8.log" || true

echo "== bench_fp8"
timeout 1500 "$PY" benchmarks/bench_fp8.py ${BENCH_ARGS:-} 2>&1 | tee "$LOG_DIR/bench_fp8.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== tile sweep (block-scaled, every compiled tile; data for the heuristic)"
timeout 600 "$PY" benchmarks/bench_fp8.py --sweep --rounds 3 --out "$LOG_DIR/sweep" \
  --shapes ${SWEEP_SHAPES:-8192,8192,8192 4096,7168,16384 64,28672,4096 128,7168,16384} \
  2>&1 | tee "$LOG_DIR/bench_fp8_sweep.log" || status=1
cp -r benchmarks/results "$LOG_DIR/" 2>/dev/null || true

echo "== summary"
grep -E "passed|failed" "$LOG_DIR/pytest_fp8.log" | tail -n 1
grep -E "^Geometric mean" "$LOG_DIR/bench_fp8.log" || true
[ "$status" -eq 0 ] && echo "SUMMARY: OK" || echo "SUMMARY: FAILED"
exit "$status"
