"""Helpers the test modules import (`from support import ...`; pyproject.toml puts tests/ on
sys.path): the repository root, extension gating, CUDA lowering text, random operands and
float64 references. Imported after conftest.py has set the environment jax reads at start."""

from __future__ import annotations

import os
import pathlib

import jax
import numpy as np
import pytest

from jax_tma import _ext

# The repository root for the tests' paths (benchmarks/, examples/, tools/, csrc/), however deep
# the test module sits. Resolved through symlinks, as the tests' own paths always were (Bazel's
# runfiles tree links each file to the source tree).
REPO = pathlib.Path(__file__).resolve().parents[1]

# Tests that read the extension (CUDA lowering, SASS): skipped without it, unless
# JAX_TMA_REQUIRE_EXTENSION=1 (CI with nvcc) makes a missing extension a failure.
needs_extension = pytest.mark.skipif(
    _ext.extension_error() is not None and os.environ.get("JAX_TMA_REQUIRE_EXTENSION") != "1",
    reason="extension not built",
)


def cuda_hlo(fn, *args) -> str:
    """StableHLO of fn(*args) lowered for CUDA (works on a machine without a GPU)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def target_calls(hlo: str, target: str) -> int:
    """Custom calls to `target` in StableHLO text (@target) or compiled HLO (target="...")."""
    return hlo.count(f"@{target}(") + hlo.count(f'"{target}"')


def hopper_available() -> bool:
    devices = _ext.cuda_devices()
    return bool(devices) and _ext.non_hopper_reason(devices) is None


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Standard-normal values rounded to `dtype` (never zeros)."""
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def f64_matmul(a, b) -> np.ndarray:
    return np.asarray(a, np.float64) @ np.asarray(b, np.float64)


def rel_error(x, ref) -> float:
    """Frobenius-norm relative error; NaN anywhere in x gives NaN (which fails any bound)."""
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300))
