"""The tile registry (jax_tma/_core/tiles.py) is the one source of the compiled tiles: the
generated C++ (scripts/gen_tiles.py) is current, the op configs' tuples are the registry's, every
registry tile is in the generated header's lists, and every instantiation file is built."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from jax_tma._core import tiles
from jax_tma.ops.dense import config as dense_config
from jax_tma.ops.fp8 import config as fp8_config
from jax_tma.ops.gemm import config as gemm_config
from jax_tma.ops.ragged import config as ragged_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "scripts" / "gen_tiles.py"
HEADER = ROOT / "csrc" / "contract" / "sm90_tiles.generated.h"


def _macro_items(text: str, name: str) -> list[str]:
    """The second argument of each X(...) in the #define of `name` (the tiles of a list)."""
    found = re.search(rf"#define {name}\(X, ARG\)((?:[^\n]*\\\n)*[^\n]*)", text)
    assert found, f"no #define {name} in {HEADER.name}"
    return re.findall(r"X\(ARG, (\w+)\)", found.group(1))


def test_generated_files_are_current():
    result = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_check_fails_on_a_stale_header(tmp_path, monkeypatch):
    """--check must be able to fail: a header that lost one tile is reported."""
    spec = importlib.util.spec_from_file_location("gen_tiles", GENERATOR)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    stale = tmp_path / HEADER.name
    stale.write_text(HEADER.read_text().replace("  X(ARG, Tile64x64Direct)\n", ""))
    monkeypatch.setattr(gen, "HEADER_PATH", stale)
    assert gen.main(["--check"]) == 1


def test_python_configs_are_the_registry():
    assert gemm_config._COMPILED_TILES == tiles.gemm_tiles()
    assert tuple(c.tile for c in gemm_config.COMPILED_CONFIGS) == tuple(
        e.tile.key for e in tiles.GEMM_TILES if e.tile.epilogue == tiles.TMA_STORE)
    assert {c.tile for c in gemm_config.COMPILED_CONFIGS if c.has_direct_store} == {
        e.tile.key for e in tiles.GEMM_TILES if e.tile.epilogue == tiles.DIRECT}
    assert tuple(c.tile for c in dense_config.DENSE_CONFIGS) == tiles.keys(tiles.DENSE_TILES)
    assert tuple(c.tile for c in dense_config.configs_for("forward", "gelu_erf")) == tiles.keys(
        tiles.DENSE_NARROW_TILES)
    assert tuple(c.tile for c in dense_config.configs_for("gated_gradient", "silu")) == (
        tiles.keys(tiles.DENSE_RING_TILES))
    assert tuple(c.tile for c in fp8_config.FP8_CONFIGS) == tiles.keys(tiles.FP8_TILES)
    assert tuple(c.tile for c in fp8_config.FP8_FAST_CONFIGS) == tiles.keys(tiles.FP8_FAST_TILES)
    assert tuple(c.tile for c in fp8_config.FP8_RAGGED_CONFIGS) == tiles.keys(
        tiles.FP8_RAGGED_TILES)
    # Fast and ragged tiles are validated as Fp8Config tiles.
    assert set(tiles.keys(tiles.FP8_RAGGED_TILES)) <= set(tiles.keys(tiles.FP8_TILES))
    assert set(tiles.keys(tiles.FP8_FAST_TILES)) <= set(tiles.keys(tiles.FP8_TILES))
    assert tuple(c.tile for c in ragged_config.RAGGED_CONFIGS) == tiles.keys(tiles.RAGGED_TILES)
    assert tuple(c.tile for c in ragged_config.GATED_RAGGED_CONFIGS) == tiles.keys(
        tiles.RAGGED_GATED_TILES)
    # The gated ragged tiles are tiles the gated dense fusion compiles already.
    assert set(tiles.keys(tiles.RAGGED_GATED_TILES)) <= set(tiles.keys(tiles.DENSE_TILES))
    assert tuple(c.tile for c in ragged_config.GATED_RAGGED_GRAD_CONFIGS) == tiles.keys(
        tiles.RAGGED_GATED_GRAD_TILES)
    # The gated gradient ragged tiles are the dense gated gradient's (the epilogue warps' ring).
    assert set(tiles.keys(tiles.RAGGED_GATED_GRAD_TILES)) <= set(
        tiles.keys(tiles.DENSE_RING_TILES))


@pytest.mark.parametrize("macro, entries", [
    ("JAX_TMA_SM90_GEMM_TILES", tiles.GEMM_TILES),
    ("JAX_TMA_SM90_RAGGED_TILES", tiles.RAGGED_TILES),
    ("JAX_TMA_SM90_RAGGED_GATED_TILES", tiles.RAGGED_GATED_TILES),
    ("JAX_TMA_SM90_RAGGED_GATED_GRAD_TILES", tiles.RAGGED_GATED_GRAD_TILES),
    ("JAX_TMA_SM90_DENSE_TILES", tiles.DENSE_TILES),
    ("JAX_TMA_SM90_DENSE_NARROW_TILES", tiles.DENSE_NARROW_TILES),
    ("JAX_TMA_SM90_DENSE_RING_TILES", tiles.DENSE_RING_TILES),
    ("JAX_TMA_SM90_FP8_TILES", tiles.FP8_TILES),
    ("JAX_TMA_SM90_FP8_FAST_TILES", tiles.FP8_FAST_TILES),
    ("JAX_TMA_SM90_FP8_RAGGED_TILES", tiles.FP8_RAGGED_TILES),
])
def test_header_lists_every_registry_tile(macro, entries):
    text = HEADER.read_text()
    assert _macro_items(text, macro) == [e.tile.cxx for e in entries]
    for e in entries:
        assert e.tile.cxx_definition() in text, e.tile.cxx
        assert e.why and "\n" not in e.why, e.tile.cxx


def test_dropped_tiles_are_not_compiled():
    """Issue 59 dropped the GEMM 64 x 256 pair and the dense 128 x 256 pair."""
    assert (64, 256, 4, 2) not in gemm_config.GemmConfig.TILES
    assert (128, 256, 3, 2) not in {c.tile for c in dense_config.DENSE_CONFIGS}
    assert (128, 256, 3, 2) not in dense_config._RING_TILES
    assert "Tile64x256C2" not in HEADER.read_text()


def test_every_instantiation_file_is_built():
    """The registry's instantiation files exist and are the kernel sources CMake and Bazel list,
    the largest first in CMake."""
    units = tiles.translation_units()
    kernels = ROOT / "csrc" / "kernels"
    assert sorted(p.name for p in kernels.glob("sm90_*.cu")) == sorted(tiles.expected_entries())
    cmake = (ROOT / "cmake" / "kernels" / "CMakeLists.txt").read_text()
    listed = re.findall(r"\$\{_csrc\}/kernels/(sm90_\w+\.cu)", cmake)
    assert sorted(listed) == sorted(tiles.expected_entries())
    bazel = (ROOT / "BUILD.bazel").read_text()
    assert sorted(set(re.findall(r'"csrc/kernels/(sm90_\w+\.cu)"', bazel))) == sorted(
        tiles.expected_entries())
    assert [u.name for u in units] == [n for n in listed if n in {u.name for u in units}]


def test_counts():
    counts = tiles.kernel_counts()
    assert counts["gemm"] == len(tiles.GEMM_TILES) * 4 * 4
    assert counts["dense"] == 2 * (3 * 11 + 2 * 1 + 1 * 2)
    assert counts["ragged_gated"] == 2 * len(tiles.RAGGED_GATED_TILES) * 3
    assert counts["ragged_gated_grad"] == 2 * len(tiles.RAGGED_GATED_GRAD_TILES) * 2
    assert counts["fp8_ragged"] == len(tiles.FP8_RAGGED_TILES) * len(tiles.FP8_RAGGED_OUT_TYPES)
    assert sum(tiles.expected_entries().values()) == sum(counts.values()) + sum(
        tiles.OTHER_KERNEL_FILES.values())
