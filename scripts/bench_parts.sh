#!/usr/bin/env bash
# Runs parts FIRST..LAST of a bench_gemm suite split into COUNT parts (--part I/COUNT), one after
# another, starting a part only while BUDGET_S seconds (from the script's start) leave room for
# one more as long as the longest so far; then packs every report under $OUT/reports.tgz (one
# file, where a device's output folder takes few). Logs: $OUT/partI.log.
#
# With --autotune and no --autotune-cache, every part tunes into one cache file that outlives
# the call ($BENCH_PARTS_CACHE, default /tmp/bench_parts_autotune.json): a part cut by a time
# limit and run again on the same machine finds the products it had tuned there.
#
#   bash scripts/bench_parts.sh COUNT FIRST LAST BUDGET_S [bench_gemm arguments...]
#   bash scripts/bench_parts.sh 10 1 5 480 --random 200 --seed 7 --autotune --commit abc1234
set -uo pipefail
cd "$(dirname "$0")/.."
count=$1 first=$2 last=$3 budget=$4
shift 4
out="${OUT:-bench_parts_out}"
mkdir -p "$out/reports"
case " $* " in
  *" --autotune "*)
    case " $* " in
      *" --autotune-cache"*) ;;
      *)
        cache="${BENCH_PARTS_CACHE:-/tmp/bench_parts_autotune.json}"
        echo "tuning into $cache"
        set -- "$@" --autotune-cache "$cache"
        ;;
    esac
    ;;
esac
start=$(date +%s) longest=0
for ((i = first; i <= last; i++)); do
  now=$(( $(date +%s) - start ))
  if (( now + longest > budget )); then
    echo "part $i not started: ${now}s gone, the longest part took ${longest}s"
    break
  fi
  t0=$(date +%s)
  timeout $(( budget - now + 30 )) python3 benchmarks/bench_gemm.py "$@" --part "$i/$count" \
    --out "$out/reports" >"$out/part$i.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - t0 ))
  (( took > longest )) && longest=$took
  echo "part $i/$count rc=$rc ${took}s"
  grep -E "^geometric mean|^jax_tma_untuned \(" "$out/part$i.log"
done
tar -C "$out" -czf "$out/reports.tgz" reports && rm -rf "$out/reports"
