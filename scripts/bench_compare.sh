#!/usr/bin/env bash
# A/B of two builds on one machine: this working tree against another tree (an earlier commit's
# files, e.g. `git archive <commit> | tar -x -C .old`). Builds both side by side (non-editable,
# into /tmp/ab_new and /tmp/ab_old), then runs each benchmark's --quick suite for both builds:
# with two GPUs at once, the new one on GPU 0 and the old one on GPU 1; with one GPU one after
# the other, benchmark by benchmark (each compares jax_tma with XLA in its own run). Packs the
# reports and logs into $OUT/bench_compare.tgz.
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
# A target that already holds a built extension (an earlier run's) is not built again.
built() { compgen -G "$1/jax_tma/_jax_tma*.so" >/dev/null; }
ensure() {  # tree, target
  if built "$2"; then return 0; fi
  build "$1" "$2"
}
# An editable install of jax_tma in this Python wins over PYTHONPATH (its import hook comes
# first), so both suites would measure it: refuse.
for pkg in /tmp/ab_new /tmp/ab_old; do
  found=$(cd /tmp && PYTHONPATH=$pkg python3 -c "import jax_tma; print(jax_tma.__file__)" 2>/dev/null)
  case "$found" in
    "$pkg"/*|"") ;;
    *) echo "jax_tma imports from $found, not $pkg: pip uninstall jax_tma first"; exit 1 ;;
  esac
done
ensure "$root" /tmp/ab_new & ensure "$old" /tmp/ab_old &
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
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  suite "$root" /tmp/ab_new 0 new & suite "$old" /tmp/ab_old 1 old &
  wait
else
  all=$benches
  for benches in $all; do
    suite "$old" /tmp/ab_old 0 old
    suite "$root" /tmp/ab_new 0 new
  done
fi
tar -C "$out" -czf "$out/bench_compare.tgz" ab && rm -rf "$out/ab"
echo "wrote $out/bench_compare.tgz"
