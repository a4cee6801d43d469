"""ptxas resource report of the GEMM kernels: no spills, no local memory, and no serialized
wgmma ("Potential Performance Loss", C7510/C7511), which ptxas reports as information, not as
a warning, so the build's -Werror cannot catch it. Compiles each instantiation file (7 tile
configurations x 4 operand layouts) with nvcc -Xptxas=-v and the build's ptxas flags; nvcc is
found by tools/find_nvcc.py, the rule the build uses.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted((ROOT / "csrc" / "kernels").glob("sm90_gemm_*.cu"))
RAGGED_FILES = sorted((ROOT / "csrc" / "kernels").glob("sm90_ragged_*.cu"))
DENSE_FILES = sorted((ROOT / "csrc" / "kernels").glob("sm90_dense_*.cu"))
FP8_FILES = sorted((ROOT / "csrc" / "kernels").glob("sm90_fp8_*.cu"))

# The build's flags for the kernels (cmake/kernels/CMakeLists.txt; tests/test_packaging.py checks
# that they agree), less -lineinfo, plus -v for ptxas's resource report.
NVCC_FLAGS = [
    "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
    "-Xptxas=-v,-warn-spills,-warn-lmem-usage,-Werror",
]


def load_find_nvcc():
    """tools/find_nvcc.py as a module: the build's rule for where nvcc is."""
    spec = importlib.util.spec_from_file_location("find_nvcc", ROOT / "tools" / "find_nvcc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nvcc() -> str:
    found, how = load_find_nvcc().find_nvcc()
    if found is None:
        if os.environ.get("JAX_TMA_REQUIRE_EXTENSION") == "1":
            pytest.fail(f"nvcc not found: {how}")
        pytest.skip(f"nvcc not found: {how}")
    return found


def test_instantiation_files_found():
    assert len(KERNEL_FILES) == 4, KERNEL_FILES


@pytest.mark.parametrize("source", KERNEL_FILES, ids=lambda p: p.name)
def test_gemm_kernels_compile_without_spills_or_serialized_wgmma(source, tmp_path):
    result = subprocess.run(
        [_nvcc(), "-c", str(source), "-o", str(tmp_path / "k.o"), f"-I{ROOT / 'csrc'}", *NVCC_FLAGS],
        capture_output=True, text=True, check=False,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-4000:]
    entries = re.findall(r"Compiling entry function '(\w+)'", report)
    assert len(entries) == 60, report[-4000:]  # 15 tiles x 4 layouts
    # Every (A, B) layout: K-major or MN-major each.
    layouts = {re.search(r"OperandLayoutILNS0_5MajorE(\d)ELS\w*?_(\d)E", e).groups() for e in entries}
    assert len(layouts) == 4, layouts
    assert "Potential Performance Loss" not in report, report[-4000:]
    assert not re.search(r"C751[01]", report), report[-4000:]
    spills = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == len(entries)
    assert all(s == ("0", "0", "0") for s in spills), spills


def _ptxas_report(source, tmp_path) -> tuple[str, list[str]]:
    """ptxas's report of one instantiation file compiled with the build's flags, and its
    kernels' names."""
    result = subprocess.run(
        [_nvcc(), "-c", str(source), "-o", str(tmp_path / "k.o"), f"-I{ROOT / 'csrc'}",
         *NVCC_FLAGS],
        capture_output=True, text=True, check=False,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-4000:]
    return report, re.findall(r"Compiling entry function '(\w+)'", report)


def _assert_clean(report: str, entries: list[str]) -> None:
    assert "Potential Performance Loss" not in report, report[-4000:]
    assert not re.search(r"C751[01]", report), report[-4000:]
    spills = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == len(entries)
    assert all(s == ("0", "0", "0") for s in spills), spills


def test_ragged_and_fused_instantiation_files_found():
    assert len(RAGGED_FILES) == 5, RAGGED_FILES  # 4 type pairs + the prepare kernel
    assert len(DENSE_FILES) == 2, DENSE_FILES  # bf16, fp16


@pytest.mark.parametrize("source", RAGGED_FILES, ids=lambda p: p.name)
def test_ragged_kernels_compile_without_spills_or_serialized_wgmma(source, tmp_path):
    report, entries = _ptxas_report(source, tmp_path)
    # 5 tiles x (rows NN, rows NT, contraction TN), or the one prepare kernel
    assert len(entries) == (1 if "prepare" in source.name else 15), report[-4000:]
    _assert_clean(report, entries)


@pytest.mark.parametrize("source", DENSE_FILES, ids=lambda p: p.name)
def test_fused_dense_kernels_compile_without_spills_or_serialized_wgmma(source, tmp_path):
    report, entries = _ptxas_report(source, tmp_path)
    # JAX_TMA_SM90_DENSE_KERNELS: 4 tiles x 11 fusions, the erf gelu on 2 narrow tiles, the
    # gated gradient (2 activations) on the 2 ring tiles.
    assert len(entries) == 4 * 11 + 2 + 2 * 2, report[-4000:]
    _assert_clean(report, entries)


def test_fp8_instantiation_files_found():
    assert [p.name for p in FP8_FILES] == ["sm90_fp8_bf16.cu", "sm90_fp8_f32.cu"]


@pytest.mark.parametrize("source", FP8_FILES, ids=lambda p: p.name)
def test_fp8_kernels_compile_without_spills_or_serialized_wgmma(source, tmp_path):
    """The FP8 mainloop holds a K slice's partial sums beside the promoted accumulators (64 +
    128 registers on 128 x 256 tiles): no spill, no serialized wgmma."""
    report, entries = _ptxas_report(source, tmp_path)
    # JAX_TMA_SM90_FP8_KERNELS: 6 tiles x 2 FP8 types, and the unpromoted tile with fp32 out.
    assert len(entries) == 6 * 2 + (1 if "f32" in source.name else 0), report[-4000:]
    assert all("Fp8Mainloop" in e for e in entries)
    _assert_clean(report, entries)
