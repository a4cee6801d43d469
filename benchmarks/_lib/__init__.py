"""What the benchmarks share: the run's record and report files (report.py), their command
lines: shapes, harness options, parts of a suite (harness.py), the GEMM shape suites
(shapes.py), GEMM operand sets sized against L2 (operands.py), and the fused-epilogue patterns
with their operands and contenders (patterns.py). Imported as ``_lib`` from the scripts beside
it; no script imports another."""
