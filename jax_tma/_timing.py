"""Timing harness shared by ``python -m jax_tma`` and benchmarks/.

Every timed call evaluates ``reps_per_call`` products on distinct input pairs inside one
``jit`` and returns all outputs, so XLA can neither merge identical products nor slice them
away, and dispatch overhead is spread over many kernels. Inputs are random (never zeros).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float  # per product
    spread_s: float  # (max - min) / 2 per product over the repeats
    samples: int


def random_operands(key: jax.Array, shapes: Sequence[tuple[int, ...]], dtype, count: int):
    """``count`` independent tuples of standard-normal arrays with the given shapes."""
    keys = jax.random.split(key, count * len(shapes))
    out = []
    for i in range(count):
        out.append(
            tuple(
                jax.random.normal(keys[i * len(shapes) + j], s, jnp.float32).astype(dtype)
                for j, s in enumerate(shapes)
            )
        )
    return out


def time_products(
    product: Callable[..., jax.Array],
    operand_sets: Sequence[tuple[jax.Array, ...]],
    *,
    warmup: int = 2,
    repeats: int = 7,
) -> Timing:
    """Median wall time of one product, measured over jitted batches of distinct inputs."""

    @jax.jit
    def batch(sets):
        return [product(*ops) for ops in sets]

    sets = list(operand_sets)
    for _ in range(warmup):
        jax.block_until_ready(batch(sets))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(batch(sets))
        samples.append((time.perf_counter() - start) / len(sets))
    return Timing(statistics.median(samples), (max(samples) - min(samples)) / 2, len(samples))


def tflops(m: int, n: int, k: int, seconds: float) -> float:
    return 2.0 * m * n * k / seconds / 1e12


def relative_error(x, ref) -> float:
    """Frobenius-norm relative error of x against ref, computed in float64."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (denom if denom > 0 else 1.0))
