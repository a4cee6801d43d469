"""The benchmark scripts run: argument parsing, harness and output files, through --dry-run
(tiny sizes; without a Hopper GPU a stand-in is timed and the script says so). Timings are
never asserted."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from jax_tma import _ext

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["bench_tma_copy.py"])
def test_benchmark_dry_run(script, tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / script.replace(".py", ".json")).read_text())
    assert report["dry_run"] and report["results"]
    if not _ext.kernel_status().available:
        assert "kernel path unavailable" in result.stdout


def test_bench_gemm_dry_run():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_gemm.py"), "--dry-run"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    for shape in ("64×64×64", "7×129×72"):
        assert f"| {shape} |" in result.stdout, result.stdout
    assert "geometric mean of the ratio" in result.stdout


def test_bench_gemm_rejects_bad_shapes():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_gemm.py"), "--dry-run", "--shapes", "4,4"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 2 and "M,N,K triples" in result.stderr
