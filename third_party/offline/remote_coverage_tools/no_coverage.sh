#!/bin/sh
# Stands in for Bazel's coverage tools, which this offline setup does not have.
echo "jax_tma: bazel coverage is not supported offline (no remote_coverage_tools)" >&2
exit 1
