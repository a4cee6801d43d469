"""What the benchmarks share: the run's record and report files (report.py), and their command
lines: shapes, harness options, parts of a suite (harness.py). Imported as ``_lib`` from the
scripts beside it."""
