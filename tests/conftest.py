"""Shared test helpers: Hopper-GPU gating, random operands and float64 references."""

from __future__ import annotations

import os
import zlib

# Eight CPU devices for the sharding tests (meshes of 8, 4x2 and 2x4), set before jax starts;
# the default device (GPU where there is one, else CPU 0) is unaffected.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# GPU tests that run a subprocess (cross-process determinism, sizes near 2^31 with a 32 GiB
# operand) need the memory XLA would otherwise preallocate for this process (75 % of the GPU).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# The GEMM lowering leaves XLA's dot the products it computes faster (K < 64, narrow outputs,
# operand copies that cost more than the product: gemm_config.xla_reason). The tests exercise
# the kernel and its lowering on small products, so they take the kernel wherever it can run;
# the tests of that choice pass xla_when_faster=True or set the variable to 0 themselves.
os.environ.setdefault("JAX_TMA_KERNEL_ALWAYS", "1")

import jax
import numpy as np
import pytest

from jax_tma import _ext

# Tests that read the extension (CUDA lowering, SASS): skipped without it, unless
# JAX_TMA_REQUIRE_EXTENSION=1 (CI with nvcc) makes a missing extension a failure.
needs_extension = pytest.mark.skipif(
    _ext.extension_error() is not None and os.environ.get("JAX_TMA_REQUIRE_EXTENSION") != "1",
    reason="extension not built",
)


def cuda_hlo(fn, *args) -> str:
    """StableHLO of fn(*args) lowered for CUDA (works on a machine without a GPU)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def hopper_available() -> bool:
    devices = _ext.cuda_devices()
    return bool(devices) and _ext.non_hopper_reason(devices) is None


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip without a Hopper GPU.

    JAX_TMA_REQUIRE_GPU=1 (set by scripts/gpu_check.sh) makes a missing GPU an error instead,
    so a GPU run can never pass by skipping.
    """
    if hopper_available():
        return
    if os.environ.get("JAX_TMA_REQUIRE_GPU") == "1":
        raise pytest.UsageError("JAX_TMA_REQUIRE_GPU=1 but no Hopper (sm_90) GPU is visible")
    skip = pytest.mark.skip(reason="needs a Hopper (compute capability 9.0) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test id, so every case draws its own reproducible data."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def exact_f32():
    """float32 products at full precision: on a GPU XLA's default for them is TF32, whose
    rounding (~1e-3) a finite-difference gradient check divides by its step and reports as
    errors of order 1. Tests of float32 results or gradients (which run through XLA's dot, not
    the kernel) use it to check jax_tma's rules rather than TF32 on every backend."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture
def on_cpu():
    """Runs the test on the CPU device: lax-parity tests that compare bits hold on a GPU
    machine too (there the kernel's results differ from XLA's dot within the error bounds,
    which the GPU tests check)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield
