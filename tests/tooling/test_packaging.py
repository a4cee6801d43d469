"""Packaging: where the build looks for nvcc, when it must fail instead of installing without
kernels, what import says when the extension is missing or broken, and that the two build
descriptions (CMake, Bazel) compile the kernels with the same flags through the same launcher
(tools/nvcc_ptxas_report.py, whose reports tests/kernels/test_ptxas.py reads).

CPU-only: fake compilers are shell scripts in a temporary directory; the CMake checks configure
a scratch build directory and stop before any compilation.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from support import REPO


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


find_nvcc = _load("find_nvcc", REPO / "tools" / "find_nvcc.py")


def _fake_nvcc(root: pathlib.Path) -> str:
    """An executable named nvcc under root/bin; returns its path."""
    path = root / "bin" / "nvcc"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\nexit 1\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def toolkits(tmp_path):
    """Four fake toolkits: on PATH, under CUDA_HOME, under CUDA_PATH, at a default root."""
    return {name: _fake_nvcc(tmp_path / name) for name in ("path", "home", "cuda_path", "default")}


def _find(env, tmp_path):
    return find_nvcc.find_nvcc(env, default_roots=(str(tmp_path / "default"),), versioned_glob=None)


@pytest.mark.parametrize(
    "present, expected",
    [
        (("path", "home", "cuda_path", "default"), "path"),
        (("home", "cuda_path", "default"), "home"),
        (("cuda_path", "default"), "cuda_path"),
        (("default",), "default"),
    ],
)
def test_find_nvcc_order(toolkits, tmp_path, present, expected):
    env = {"PATH": "/nonexistent"}
    if "path" in present:
        env["PATH"] = f"/nonexistent:{tmp_path / 'path' / 'bin'}"
    if "home" in present:
        env["CUDA_HOME"] = str(tmp_path / "home")
    if "cuda_path" in present:
        env["CUDA_PATH"] = str(tmp_path / "cuda_path")
    if "default" not in present:
        shutil.rmtree(tmp_path / "default")
    found, how = _find(env, tmp_path)
    assert found == toolkits[expected], how


def test_find_nvcc_cudacxx_wins(toolkits, tmp_path):
    env = {"PATH": str(tmp_path / "path" / "bin"), "CUDACXX": toolkits["home"]}
    found, how = _find(env, tmp_path)
    assert found == toolkits["home"] and how.startswith("CUDACXX="), how


def test_find_nvcc_bad_cudacxx_is_an_error(toolkits, tmp_path):
    env = {"PATH": str(tmp_path / "path" / "bin"), "CUDACXX": str(tmp_path / "missing" / "nvcc")}
    with pytest.raises(find_nvcc.NvccError, match="CUDACXX=.*missing/nvcc is not an executable"):
        _find(env, tmp_path)


def test_find_nvcc_none_lists_every_place(tmp_path):
    env = {"PATH": "/nonexistent", "CUDA_HOME": str(tmp_path / "home")}
    found, how = _find(env, tmp_path)
    assert found is None
    for where in ("CUDACXX", "PATH", "CUDA_HOME", str(tmp_path / "default")):
        assert where in how, how


def test_find_nvcc_prefers_the_newest_versioned_toolkit(tmp_path):
    older = _fake_nvcc(tmp_path / "cuda-12.9")
    newer = _fake_nvcc(tmp_path / "cuda-13.0")
    found, _ = find_nvcc.find_nvcc(
        {"PATH": "/nonexistent"}, default_roots=(), versioned_glob=str(tmp_path / "cuda-*")
    )
    assert found == newer != older


def test_find_nvcc_script_prints_the_path(toolkits, tmp_path):
    env = {"PATH": f"{tmp_path / 'path' / 'bin'}:/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "find_nvcc.py")],
        env=env, capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == toolkits["path"]


# --- CMake: what a configure does with a missing, broken or disabled compiler ---------------


def _words(text: str) -> str:
    """CMake wraps its messages: compare them with runs of whitespace as one space."""
    return " ".join(text.split())


def _configure(tmp_path, **env_overrides) -> subprocess.CompletedProcess:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not found")
    # Only what the test names: CI exports JAX_TMA_REQUIRE_KERNELS=1, and a developer may have
    # CUDACXX or CUDA_HOME set.
    ignored = ("CUDACXX", "CUDA_HOME", "CUDA_PATH", "JAX_TMA_BUILD_CUDA", "JAX_TMA_REQUIRE_KERNELS",
               "JAX_TMA_BUILD_TESTING")
    env = {k: v for k, v in os.environ.items() if k not in ignored}
    env.update(env_overrides)
    return subprocess.run(
        [cmake, "-S", str(REPO), "-B", str(tmp_path / "build"), f"-DPython_EXECUTABLE={sys.executable}"],
        env=env, capture_output=True, text=True, check=False, timeout=300,
    )


def test_cmake_broken_compiler_fails_the_build(tmp_path):
    """A compiler that is found but does not work is an error, never a pure-Python install."""
    nvcc = _fake_nvcc(tmp_path / "broken")
    result = _configure(tmp_path, CUDACXX=nvcc)
    assert result.returncode != 0, result.stdout[-3000:]
    assert f"CUDA compiler {nvcc}" in _words(result.stdout)


def test_cmake_bad_cudacxx_fails_the_build(tmp_path):
    result = _configure(tmp_path, CUDACXX=str(tmp_path / "missing" / "nvcc"))
    assert result.returncode != 0
    assert "is not an executable CUDA compiler" in _words(result.stderr)


def test_cmake_refuses_cuda_older_than_12_8(tmp_path):
    """The real nvcc behind a wrapper that makes CMake's compiler identification read 12.4."""
    real, _ = find_nvcc.find_nvcc()
    if real is None:
        pytest.skip("no nvcc to wrap")
    wrapper = tmp_path / "old" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f"""#!/bin/bash
args=()
for arg in "$@"; do
  if [[ "$arg" == *CMakeCUDACompilerId.cu ]]; then
    fake="$(dirname "$arg")/Old.cu"
    printf '#undef __CUDACC_VER_MAJOR__\\n#define __CUDACC_VER_MAJOR__ 12\\n' > "$fake"
    printf '#undef __CUDACC_VER_MINOR__\\n#define __CUDACC_VER_MINOR__ 4\\n' >> "$fake"
    cat "$arg" >> "$fake"
    arg="$fake"
  fi
  args+=("$arg")
done
exec {real} "${{args[@]}}"
""")
    wrapper.chmod(0o755)
    result = _configure(tmp_path, CUDACXX=str(wrapper))
    assert result.returncode != 0, result.stdout[-3000:]
    assert "is CUDA 12.4" in _words(result.stderr) and "need CUDA >= 12.8" in _words(result.stderr)


def test_cmake_without_cuda_warns_and_installs_pure_python(tmp_path):
    result = _configure(tmp_path, JAX_TMA_BUILD_CUDA="0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WITHOUT its CUDA kernels" in _words(result.stderr)


def test_cmake_require_kernels_turns_a_missing_build_into_an_error(tmp_path):
    result = _configure(tmp_path, JAX_TMA_BUILD_CUDA="0", JAX_TMA_REQUIRE_KERNELS="1")
    assert result.returncode != 0
    assert "JAX_TMA_REQUIRE_KERNELS is on" in _words(result.stderr)


# --- What import says about the extension ----------------------------------------------------


def _load_ext_in(package_dir: pathlib.Path, monkeypatch):
    """jax_tma/_ext.py loaded as a submodule of a scratch package at package_dir."""
    package_dir.mkdir(exist_ok=True)
    (package_dir / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(package_dir.parent))
    name = package_dir.name
    monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(f"{name}._ext", REPO / "jax_tma" / "_ext.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, f"{name}._ext", module)
    spec.loader.exec_module(module)
    return module


def test_extension_not_built_says_so(tmp_path, monkeypatch):
    ext = _load_ext_in(tmp_path / "scratch_not_built", monkeypatch)
    message = ext.extension_error()
    assert message.startswith("the jax_tma extension is not built"), message
    assert "CUDACXX" in message and "JAX_TMA_REQUIRE_KERNELS" in message
    assert "circular import" not in message


def test_extension_that_fails_to_load_gives_the_loaders_message(tmp_path, monkeypatch):
    package = tmp_path / "scratch_broken"
    package.mkdir()
    broken = package / f"_jax_tma{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    broken.write_bytes(b"not an ELF file")
    ext = _load_ext_in(package, monkeypatch)
    message = ext.extension_error()
    assert f"the jax_tma extension {broken} is built but fails to load" in message, message
    assert "not built" not in message


# --- One set of kernel flags --------------------------------------------------------------------


_FLAG = re.compile(r"(-gencode=[\w,=]+|--expt-relaxed-constexpr|-Xptxas=[\w,-]+|-std=c\+\+\d+)")


def test_kernel_flags_agree():
    cmake_text = (REPO / "cmake" / "kernels" / "CMakeLists.txt").read_text()
    cmake_text = cmake_text[cmake_text.index("target_compile_options"):]
    # The debug build's branch (JAX_TMA_DEBUG=1) drops -Werror on purpose: leave it out.
    debug = cmake_text.index('if("$ENV{JAX_TMA_DEBUG}"')
    cmake_text = cmake_text[:debug] + cmake_text[cmake_text.index("else()", debug):]
    cmake = set(_FLAG.findall(cmake_text))
    bazel_text = (REPO / "third_party" / "cuda_rules.bzl").read_text()
    start = bazel_text.index("NVCC_FLAGS = [")
    bazel = set(_FLAG.findall(bazel_text[start:bazel_text.index("]", start)]))
    assert cmake == bazel and len(cmake) == 3, (cmake, bazel)
    # Line tables (12 % of the compile) only where asked for: never in Bazel's flags, and in
    # CMake's under the debug or JAX_TMA_LINEINFO switch alone.
    assert "-lineinfo" not in bazel_text
    lineinfo = cmake_text.split('"$ENV{JAX_TMA_LINEINFO}" STREQUAL "1")', 1)
    assert len(lineinfo) == 2 and "-lineinfo" not in lineinfo[0], cmake_text
    assert lineinfo[1].index("-lineinfo") < lineinfo[1].index("endif()")
    # Both compile through the launcher that writes and checks ptxas's report; -v is its to add.
    assert "CUDA_COMPILER_LAUNCHER" in cmake_text and "tools/nvcc_ptxas_report.py" in cmake_text
    assert '"//tools:nvcc_ptxas_report.py"' in bazel_text
    assert not any("-v" in flag.split("=", 1)[-1].split(",") for flag in cmake | bazel)


# --- pyproject.toml -------------------------------------------------------------------------


def test_sdist_leaves_out_benchmark_results():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "benchmarks/results" in config["tool"]["scikit-build"]["sdist"]["exclude"]


def test_test_extension_is_left_out_of_wheels():
    """_jax_tma_testing is built for editable installs (the tests' and CI's) and not for wheels:
    off by default, turned on by the editable override alone, and built only when on."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["scikit-build"]
    assert config["cmake"]["define"]["JAX_TMA_BUILD_TESTING"] == "OFF"
    editable = [o for o in config["overrides"] if o["if"] == {"state": "editable"}]
    assert [o["cmake"]["define"]["JAX_TMA_BUILD_TESTING"] for o in editable] == ["ON"]
    cmake_text = (REPO / "CMakeLists.txt").read_text()
    guarded = cmake_text.split("if(JAX_TMA_BUILD_TESTING)", 1)[1].split("endif()", 1)[0]
    assert "nanobind_add_module(_jax_tma_testing" in guarded
    assert cmake_text.count("_jax_tma_testing NB_STATIC") == 1


def test_runtime_jax_is_bounded_to_the_tested_releases():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    jax_pin = next(d for d in config["project"]["dependencies"] if d.startswith("jax"))
    assert "<0.12" in jax_pin, jax_pin


def test_ci_runs_the_readme_test_command():
    """.ci/run runs the test command README.md gives (CI checks what users are told to run)."""
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^python3 -m pytest .*$", readme, flags=re.M)
    assert len(commands) == 1, commands
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(rf"^timeout \d+ {re.escape(commands[0])}$", ci, flags=re.M), commands[0]
