#!/usr/bin/env bash
# Runs each selected test in its own process, so a crash names the test that caused it.
#   bash scripts/run_isolated.sh tests/kernels/test_primitives.py
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
pass=0; fail=0
while IFS= read -r t; do
  if out=$("$PY" -m pytest -q -x "$t" 2>&1 </dev/null); then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    echo "FAILED: $t"
    echo "$out" | grep -E "^E |Error|Segmentation|error:|File \"/work" | head -12
  fi
done < <("$PY" -m pytest --collect-only -q "$@" 2>/dev/null | grep "::")
echo "$pass passed, $fail failed"
