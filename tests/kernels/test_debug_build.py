"""The debug build (JAX_TMA_DEBUG=1 at build time): every mbarrier wait is bounded and traps
with a report naming the barrier, its stage and phase, instead of hanging.

csrc/testing/debug_wait_trap.cu arms a full barrier for bytes no copy delivers (a wrong
transaction count). Compiled here with -DJAX_TMA_DEBUG and a short bound (CPU: it compiles, and
so do the kernels in debug mode); on a Hopper GPU the wrong count must trap with the report and
the right count must complete.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

from support import REPO

PROGRAM = REPO / "csrc" / "testing" / "debug_wait_trap.cu"
FLAGS = ["-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
         f"-I{REPO / 'csrc'}", "-DJAX_TMA_DEBUG"]


def _nvcc() -> str:
    found = os.environ.get("CUDACXX") or shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if found is None:
        if os.environ.get("JAX_TMA_REQUIRE_EXTENSION") == "1":
            pytest.fail("nvcc not found")
        pytest.skip("nvcc not found")
    return found


def _build(tmp_path) -> pathlib.Path:
    exe = tmp_path / "debug_wait_trap"
    # ~0.1 s at Hopper clocks instead of the default ~20 s.
    result = subprocess.run([_nvcc(), *FLAGS, "-DJAX_TMA_DEBUG_WAIT_CYCLES=200000000",
                             str(PROGRAM), "-o", str(exe)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return exe


def test_debug_wait_program_compiles(tmp_path):
    assert _build(tmp_path).exists()


def test_kernels_compile_in_debug_mode(tmp_path):
    source = REPO / "csrc" / "kernels" / "sm90_ragged_dot_bf16_bf16.cu"
    result = subprocess.run([_nvcc(), *FLAGS, "-c", str(source), "-o", str(tmp_path / "k.o")],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.gpu
def test_wrong_transaction_count_traps_instead_of_hanging(tmp_path):
    exe = _build(tmp_path)
    bad = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=False)
    report = bad.stdout + bad.stderr
    assert bad.returncode == 1, report
    assert "jax_tma: full barrier (consumer_wait) wait timed out: stage 0, phase 0" in report
    assert "launch: cudaErrorLaunchFailure" in report or "launch: cudaError" in report, report
    good = subprocess.run([str(exe), "ok"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert good.returncode == 0 and "launch: cudaSuccess" in good.stdout, good.stdout + good.stderr
