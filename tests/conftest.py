"""pytest setup for the whole suite: the environment set before jax starts, Hopper-GPU gating of
the tests marked `gpu`, and the fixtures. Test modules import their helpers from support.py."""

from __future__ import annotations

import functools
import inspect
import os
import re
import tempfile
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

# The kernels' lowerings read the autotuning cache: the suite uses one of its own (per process),
# never the user's, and tunes nothing at trace time unless a test asks (autotune_cache).
os.environ["JAX_TMA_AUTOTUNE_CACHE"] = os.path.join(
    tempfile.mkdtemp(prefix="jax_tma_test_cache_"), "autotune.json")
os.environ.pop("JAX_TMA_AUTOTUNE", None)

import jax
import numpy as np
import pytest

from jax_tma import _ext
# Registers the test extension's targets: jax_tma._testing's and the ops' poison=True paths.
import jax_tma._testing  # noqa: F401
from support import hopper_available


_TEST_TARGET_USE = re.compile(r"\b_testing\.|\bpoison=")


@functools.cache
def _test_target_users(module) -> re.Pattern:
    """What a call into a test-only FFI target looks like in `module`: jax_tma._testing's
    functions, an op's poison=True path, a script (a module-level string) run in a subprocess
    that calls either, or a module function that uses any of these (helpers of helpers
    included)."""
    sources = {}
    scripts = []
    for name, value in vars(module).items():
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            sources[name] = _source(value)
        elif isinstance(value, str) and _TEST_TARGET_USE.search(value):
            scripts.append(rf"|\b{re.escape(name)}\b")
    users: set[str] = set()
    while True:
        pattern = _TEST_TARGET_USE.pattern + "".join(scripts)
        pattern += "".join(rf"|\b{re.escape(u)}\(" for u in users)
        found = {n for n, src in sources.items() if re.search(pattern, src)}
        if found <= users:
            return re.compile(pattern)
        users |= found


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):  # made at run time: nothing to read
        return ""


def _uses_test_targets(item) -> bool:
    """Whether a test runs a test-only FFI target (registered by the test extension
    _jax_tma_testing), judged from its source."""
    fn = getattr(item, "function", None)
    module = getattr(item, "module", None)
    if fn is None or module is None:
        return False
    return bool(_test_target_users(module).search(_source(fn)))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip without a Hopper GPU.

    JAX_TMA_REQUIRE_GPU=1 (set by scripts/gpu_check.sh) makes a missing GPU an error instead,
    so a GPU run can never pass by skipping.
    """
    if hopper_available():
        # GPU tests of the test-only targets skip without the test extension (an install that
        # is not editable leaves it out), unless JAX_TMA_REQUIRE_EXTENSION=1 makes that a
        # failure.
        if _ext.register_testing() is None or os.environ.get("JAX_TMA_REQUIRE_EXTENSION") == "1":
            return
        skip = pytest.mark.skip(reason=f"test extension missing: {_ext.register_testing()}")
        for item in items:
            if "gpu" in item.keywords and _uses_test_targets(item):
                item.add_marker(skip)
        return
    if os.environ.get("JAX_TMA_REQUIRE_GPU") == "1":
        raise pytest.UsageError("JAX_TMA_REQUIRE_GPU=1 but no Hopper (sm_90) GPU is visible")
    skip = pytest.mark.skip(reason="needs a Hopper (compute capability 9.0) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture
def autotune_cache(tmp_path, monkeypatch):
    """An autotuning cache file of the test's own, and no JAX_TMA_AUTOTUNE from the caller."""
    path = tmp_path / "cache" / "autotune.json"
    monkeypatch.setenv("JAX_TMA_AUTOTUNE_CACHE", str(path))
    monkeypatch.delenv("JAX_TMA_AUTOTUNE", raising=False)
    return path
