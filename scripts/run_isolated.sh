#!/usr/bin/env bash
# Runs each selected test in its own process, so a crash names the test that caused it.
#   bash scripts/run_isolated.sh tests/test_primitives.py
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
pass=0; fail=0
for t in $("$PY" -m pytest --collect-only -q "$@" 2>/dev/null | grep "::"); do
  if out=$("$PY" -m pytest -q -x "$t" 2>&1); then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    echo "FAILED: $t"
    echo "$out" | grep -E "^E |Error|Segmentation|error:" | head -8
  fi
done
echo "$pass passed, $fail failed"
