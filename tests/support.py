"""Helpers the test modules import (`from support import ...`; pyproject.toml puts tests/ on
sys.path): the repository root, extension gating, CUDA lowering text, random operands and
float64 references. Imported after conftest.py has set the environment jax reads at start."""

from __future__ import annotations

import dataclasses
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


def cpu_mesh(shape, names):
    """A mesh of the first prod(shape) CPU devices; skips the test where there are fewer."""
    from jax.sharding import Mesh  # noqa: PLC0415

    devices = jax.devices("cpu")
    if len(devices) < np.prod(shape):
        pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(devices[: np.prod(shape)]).reshape(shape), names)


def f64_act(name, z):
    """The activations in float64, written out: None, relu, gelu / gelu_tanh, gelu_erf, silu."""
    z = np.asarray(z, np.float64)
    if name is None:
        return z
    if name == "relu":
        return np.maximum(z, 0)
    if name in ("gelu", "gelu_tanh"):
        return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    if name == "gelu_erf":
        from math import erf  # noqa: PLC0415
        return 0.5 * z * (1 + np.vectorize(erf)(z / np.sqrt(2)))
    if name == "silu":
        return z / (1 + np.exp(-z))
    raise ValueError(name)


def f64_act_grad(name, z):
    """d act / dz at z in float64, written out (not jax_tma's autodiff of its activation);
    relu's slope at 0 is 0."""
    z = np.asarray(z, np.float64)
    if name is None:
        return np.ones_like(z)
    if name == "relu":
        return (z > 0).astype(np.float64)
    if name in ("gelu", "gelu_tanh"):
        c = np.sqrt(2 / np.pi)
        t = np.tanh(c * (z + 0.044715 * z ** 3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z ** 2)
    if name == "gelu_erf":
        from math import erf  # noqa: PLC0415
        return (0.5 * (1 + np.vectorize(erf)(z / np.sqrt(2)))
                + z * np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi))
    if name == "silu":
        s = 0.5 * (1 + np.tanh(0.5 * z))  # the logistic sigmoid, without exp's overflow
        return s * (1 + z * (1 - s))
    raise ValueError(name)


def group_sizes(pattern: str, m: int, g: int, rng) -> np.ndarray:
    """int32 sizes of g groups over m rows in a named pattern."""
    if pattern == "uniform":
        s = np.full(g, m // g)
        s[: m % g] += 1
    elif pattern == "ragged":  # random sizes, one zero, none a multiple of the tile
        s = rng.multinomial(m, rng.dirichlet(np.ones(g) * 0.7))
        s[rng.integers(0, g)] = 0
    elif pattern == "short":  # sum < m: the rows after the last group are zero
        s = rng.multinomial(m - m // 3, np.ones(g) / g)
    elif pattern == "one":  # every row in one group, the others empty
        s = np.zeros(g, int)
        s[g // 2] = m
    elif pattern == "empty_ends":  # the first and last groups empty
        s = np.zeros(g, int)
        s[1:-1] = rng.multinomial(m, np.ones(g - 2) / (g - 2))
    elif pattern == "ones":  # one-row groups, then the rest in the last
        s = np.ones(g, int)
        s[-1] = m - (g - 1)
    elif pattern == "zipf":
        weights = 1.0 / np.arange(1, g + 1) ** 1.2
        s = rng.multinomial(m, weights / weights.sum())
    else:
        raise ValueError(pattern)
    return s.astype(np.int32)


def f64_ragged_rows(x, w, gs, w_k_major=False):
    """out[rows of g] = x[rows of g] @ w[g] in float64 (w [G, K, N], or [G, N, K] with
    w_k_major); rows past the last group zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    if w_k_major:
        w = np.swapaxes(w, 1, 2)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(gs)):
        size = int(min(max(size, 0), x.shape[0] - start))
        out[start:start + size] = x[start:start + size] @ w[g]
        start += size
    return out


def f64_ragged_contraction(x, dy, gs):
    """out[g] = x[rows of g]^T @ dy[rows of g] in float64 (sizes clamped as the kernels read
    them)."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    out = np.zeros((len(gs), x.shape[1], dy.shape[1]))
    start = 0
    for g, size in enumerate(np.asarray(gs)):
        size = int(min(max(size, 0), x.shape[0] - start))
        out[g] = x[start:start + size].T @ dy[start:start + size]
        start += size
    return out


def equations(jaxpr, primitive):
    """The equations of `primitive` in `jaxpr` and the jaxprs nested in its equations."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is primitive:
            found.append(eqn)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += equations(inner, primitive)
    return found


class FakeTuningDevice(list):
    """What fake_tuning_device's stand-in timer was asked: one list of configurations a call.
    `xla_s`: the time it gives XLA's dot (None: the tuner times no XLA contender)."""
    xla_s: float | None = None


def fake_tuning_device(monkeypatch, tuner, winner, xla_s=None) -> FakeTuningDevice:
    """Kernels 'available' and a stand-in for `tuner._time`: the configuration whose
    (tile, split_k) is `winner` (and not on stream-K) takes 1 ms, the others 2 ms and up."""
    status = _ext.kernel_status()
    monkeypatch.setattr(_ext, "kernel_status",
                        lambda: dataclasses.replace(status, available=True, reason=None))
    timed = FakeTuningDevice()
    timed.xla_s = xla_s

    def fake_time(configs, *args):
        timed.append(list(configs))
        seconds = {c.describe(): 1e-3 if (c.tile, c.split_k) == winner
                   and not getattr(c, "stream_k", False) else 2e-3 + 1e-6 * i
                   for i, c in enumerate(configs)}
        return seconds if timed.xla_s is None else (seconds, timed.xla_s)

    monkeypatch.setattr(tuner, "_time", fake_time)
    return timed
