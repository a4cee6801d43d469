"""ptxas's resource report of the sm_90a kernels: the expected entry functions per
instantiation file, every operand layout, no stack frame or spill, and no serialized wgmma
("Potential Performance Loss", C7510/C7511, which ptxas reports as information, not as a
warning, so -Werror cannot catch it).

Nothing is compiled here. The build runs every kernel compile through tools/nvcc_ptxas_report.py
(cmake/kernels/CMakeLists.txt), which adds -Xptxas=-v, writes ptxas's report beside the object
(<object>.ptxas.txt, first line "# source: <the .cu file>") and already fails the compile on a
spill or serialized wgmma. These tests read the reports of the build that made the installed
extension: scikit-build-core's build directory (pyproject.toml: build/{wheel_tag}) holding a copy
of that extension. Without one (no extension, built elsewhere) they skip, or fail under
JAX_TMA_REQUIRE_EXTENSION=1 (CI with nvcc). The launcher's own checks are tested on canned
reports.
"""

from __future__ import annotations

import filecmp
import functools
import importlib.machinery
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jax_tma._core import tiles
from support import REPO

KERNELS = REPO / "csrc" / "kernels"
LAUNCHER = REPO / "tools" / "nvcc_ptxas_report.py"


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses looks the module up by name.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


report_tool = _load("nvcc_ptxas_report", LAUNCHER)

# The entry functions ptxas compiles per instantiation file under csrc/kernels/ ("Compiling entry
# function" lines), from the tile registry: GEMM tiles x 4 operand layouts per type pair; dense
# tiles x fusions per type and fusion group (forward, gradient, gated); FP8 tiles, promoted and
# fast, per (FP8 type, output type); ragged tiles x (rows NN, rows NT,
# contraction TN); the hand-written kernels (ragged prepare, the FP8 block quantiser). Every
# sm90_*.cu file there must be listed.
EXPECTED_ENTRIES = tiles.expected_entries()

# The GEMM files instantiate every (A, B) operand layout.
ALL_LAYOUTS_FILES = sorted(name for name in EXPECTED_ENTRIES if name.startswith("sm90_gemm_"))
_LAYOUT = re.compile(r"OperandLayoutILNS0_5MajorE(\d)ELS\w*?_(\d)E")


def _missing(message: str):
    """No report to read: a failure where the kernels must have been built, else a skip."""
    if os.environ.get("JAX_TMA_REQUIRE_EXTENSION") == "1":
        pytest.fail(message)
    pytest.skip(message)


@functools.cache
def _installed_extension() -> pathlib.Path | None:
    spec = importlib.util.find_spec("jax_tma._jax_tma")
    return pathlib.Path(spec.origin) if spec is not None and spec.origin else None


@functools.cache
def _build_dir() -> pathlib.Path | str:
    """The build directory whose extension is the installed one (the only one for this Python,
    if none is byte for byte the installed file), or why there is none."""
    installed = _installed_extension()
    if installed is None:
        return "the jax_tma extension is not installed"
    name = f"_jax_tma{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    candidates = sorted(REPO.glob(f"build/*/{name}"))
    for built in candidates:
        if built.resolve() == installed.resolve() or filecmp.cmp(built, installed, shallow=False):
            return built.parent
    if len(candidates) == 1:
        return candidates[0].parent
    return (f"no build directory under {REPO / 'build'} holds the installed extension {installed} "
            f"(candidates: {[str(c) for c in candidates]})")


@functools.cache
def _reports() -> dict[pathlib.Path, pathlib.Path]:
    """Every ptxas report of the build, by the source it describes."""
    build = _build_dir()
    if isinstance(build, str):
        return {}
    found = {}
    for path in build.rglob(f"*{report_tool.REPORT_SUFFIX}"):
        with open(path) as f:
            first = f.readline()
        if first.startswith(report_tool.SOURCE_HEADER):
            found[pathlib.Path(first[len(report_tool.SOURCE_HEADER):].strip()).resolve()] = path
    return found


def _report(name: str) -> tuple[str, list[str]]:
    """The report of csrc/kernels/<name> and its entry functions."""
    build = _build_dir()
    if isinstance(build, str):
        _missing(build)
    path = _reports().get((KERNELS / name).resolve())
    if path is None:
        _missing(f"no ptxas report of {name} under {build} (the build runs every kernel compile "
                 f"through {LAUNCHER.relative_to(REPO)})")
    obj = pathlib.Path(str(path)[: -len(report_tool.REPORT_SUFFIX)])
    # An object newer than its report was compiled without the launcher: the report is stale.
    assert not obj.exists() or obj.stat().st_mtime <= path.stat().st_mtime, (obj, path)
    text = path.read_text()
    if text.splitlines()[1:2] == [f"{report_tool.CHECKED_HEADER}no"]:
        pytest.skip(f"{path} is a debug build's (JAX_TMA_DEBUG=1): slow kernels on purpose")
    return text, report_tool.parse(text).entries


def test_every_instantiation_file_has_expected_entries():
    assert sorted(p.name for p in KERNELS.glob("sm90_*.cu")) == sorted(EXPECTED_ENTRIES)


@pytest.mark.parametrize("name", sorted(EXPECTED_ENTRIES))
def test_kernels_have_no_spills_or_serialized_wgmma(name):
    text, entries = _report(name)
    assert len(entries) == EXPECTED_ENTRIES[name], text[-4000:]
    report = report_tool.parse(text)
    assert not report.serialized, report.serialized
    # One "stack frame, spill stores, spill loads" line per entry function, all zero.
    assert len(report.frames) == len(entries), text[-4000:]
    assert report.problems() == [], report.problems()
    if name.startswith("sm90_fp8_") and name not in tiles.OTHER_KERNEL_FILES:
        assert all("Fp8Mainloop" in e for e in entries), entries  # the FP8 products


@pytest.mark.parametrize("name", ALL_LAYOUTS_FILES)
def test_gemm_kernels_cover_every_operand_layout(name):
    _, entries = _report(name)
    layouts = {_LAYOUT.search(e).groups() for e in entries}
    assert len(layouts) == 4, layouts


# --- The launcher on canned reports (no nvcc) -------------------------------------------------


_CLEAN = """\
ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_90a'
ptxas info    : Function properties for _Z6kernelv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
"""
_SPILL = _CLEAN.replace("0 bytes spill stores", "8 bytes spill stores")
_FRAME = _CLEAN.replace("0 bytes stack frame", "16 bytes stack frame")
_SERIALIZED = _CLEAN + (
    "ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are "
    "serialized due to the presence of Extern calls in the function '_Z6kernelv'.\n"
)


def _fake_nvcc(tmp_path: pathlib.Path, report: str, rc: int = 0) -> str:
    """A compiler that writes the object named by -o and prints `report` when given -v."""
    (tmp_path / "report.txt").write_text(report)
    script = tmp_path / "nvcc"
    script.write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
open(args[args.index("-o") + 1], "w").write("object")
if "-Xptxas=-v" in args:
    sys.stderr.write(open({str(tmp_path / "report.txt")!r}).read())
print("a compiler warning", file=sys.stderr)
sys.exit({rc})
""")
    script.chmod(0o755)
    return str(script)


def _launch(tmp_path, report: str, *options: str, rc: int = 0) -> subprocess.CompletedProcess:
    nvcc = _fake_nvcc(tmp_path, report, rc)
    return subprocess.run(
        [sys.executable, str(LAUNCHER), *options, nvcc, "-x", "cu", "-c", "k.cu", "-o",
         str(tmp_path / "k.o")],
        capture_output=True, text=True, check=False,
    )


def test_launcher_writes_the_report_and_passes_other_messages_on(tmp_path):
    result = _launch(tmp_path, _CLEAN)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "k.o.ptxas.txt").read_text()
    assert text.startswith(f"{report_tool.SOURCE_HEADER}{os.path.abspath('k.cu')}\n"
                           f"{report_tool.CHECKED_HEADER}yes\n")
    assert report_tool.parse(text).entries == ["_Z6kernelv"]
    assert result.stderr == "a compiler warning\n"
    assert (tmp_path / "k.o").exists()


@pytest.mark.parametrize("report, why", [
    (_SPILL, "8 bytes spill stores"),
    (_FRAME, "16 bytes stack frame"),
    (_SERIALIZED, "serialized wgmma: ptxas info    : (C7510) Potential Performance Loss"),
], ids=["spill", "stack-frame", "serialized-wgmma"])
def test_launcher_fails_a_slow_kernel(tmp_path, report, why):
    result = _launch(tmp_path, report)
    assert result.returncode == 1
    assert why in result.stderr and "k.o.ptxas.txt" in result.stderr, result.stderr
    assert not (tmp_path / "k.o").exists()
    assert (tmp_path / "k.o.ptxas.txt").exists()


def test_launcher_no_check_keeps_a_slow_kernel(tmp_path):
    result = _launch(tmp_path, _SERIALIZED, "--no-check")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "k.o").exists()
    assert f"\n{report_tool.CHECKED_HEADER}no\n" in (tmp_path / "k.o.ptxas.txt").read_text()


def test_launcher_passes_the_compilers_failure_on(tmp_path):
    result = _launch(tmp_path, _CLEAN, rc=3)
    assert result.returncode == 3
    assert (tmp_path / "k.o.ptxas.txt").exists()
