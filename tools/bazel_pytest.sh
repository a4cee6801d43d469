#!/bin/sh
# Bazel test entry point (//:smoke_tests): runs tools/bazel_pytest.py with the Python that
# @local_config_jax_tma found (passed as $1) and the pytest options after it, in the test's
# runfiles tree.
set -eu
root="${TEST_SRCDIR}/${TEST_WORKSPACE}"
python="$1"
shift
exec "$python" -S "$root/tools/bazel_pytest.py" "$root" "$@"
