#!/usr/bin/env bash
# A/B of two builds on one machine: this working tree against another tree (an earlier commit's
# files, e.g. `git archive <commit> | tar -x -C .old`). Builds both side by side (non-editable,
# into /tmp/ab_new and /tmp/ab_old), then runs each benchmark's --quick suite for both builds at
# once, the new one on GPU 0 and the old one on GPU 1 (each compares jax_tma with XLA in its own
# run), and packs the reports and logs into $OUT/bench_compare.tgz.
#
#   bash scripts/bench_compare.sh OLD_TREE [benchmark ...]   # default: gemm ragged_dot epilogues fp8
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD old=$(cd "$1" && pwd)
shift
benches=${*:-gemm ragged_dot epilogues fp8}
out="${OUT:-bench_compare_out}"
mkdir -p "$out/ab"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
build() {  # tree, target
  python3 -m pip install -q --upgrade --no-build-isolation --no-deps --target "$2" "$1" \
    >"$out/ab/build_$(basename "$2").log" 2>&1
}
build "$root" /tmp/ab_new & build "$old" /tmp/ab_old &
wait -n || { echo "a build failed"; tail -20 "$out"/ab/build_*.log; exit 1; }
wait -n || { echo "a build failed"; tail -20 "$out"/ab/build_*.log; exit 1; }
suite() {  # tree, package dir, GPU, tag
  for b in $benches; do
    extra=""
    [ "$b" = gemm ] && extra="--no-pallas"
    (cd /tmp && CUDA_VISIBLE_DEVICES=$3 PYTHONPATH=$2 python3 "$1/benchmarks/bench_$b.py" --quick \
      $extra --out "$out/ab/$4" --commit "$4" >"$out/ab/$4_$b.log" 2>&1) \
      || echo "$4 bench_$b failed"
  done
}
suite "$root" /tmp/ab_new 0 new & suite "$old" /tmp/ab_old 1 old &
wait
tar -C "$out" -czf "$out/bench_compare.tgz" ab && rm -rf "$out/ab"
echo "wrote $out/bench_compare.tgz"
