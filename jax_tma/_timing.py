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


def tree_relative_error(x, ref) -> float:
    """relative_error over every leaf of two pytrees of one structure taken together."""
    flat = lambda tree: np.concatenate(  # noqa: E731
        [np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(tree)])
    return relative_error(flat(x), flat(ref))


# ------------------------------------------------------------------ kernel-time comparison

def _cupti_measure():
    """jax's CUPTI-based kernel timer (sums the durations of every kernel a call launches), or
    None where it is unavailable (no GPU, or a jax without the Mosaic GPU extension)."""
    try:
        from jax.experimental.mosaic.gpu import profiler
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    if getattr(profiler, "mosaic_gpu_lib", None) is None:
        return None
    return profiler.measure


def timing_method() -> str:
    """'cupti' (device kernel durations) on a CUDA device where jax supports it, else 'wall'."""
    on_gpu = jax.default_backend() == "gpu"
    return "cupti" if on_gpu and _cupti_measure() is not None else "wall"


def kernel_breakdown(fn: Callable[..., jax.Array], operands: Sequence[jax.Array],
                     iterations: int = 5) -> list[tuple[str, float]] | None:
    """The kernels one jitted call of ``fn(*operands)`` launches, as (name, median seconds)
    in launch order; None where CUPTI timing is unavailable."""
    measure = _cupti_measure() if timing_method() == "cupti" else None
    if measure is None:
        return None
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*operands))
    _, runs = measure(jitted, aggregate=False, iterations=iterations)(*operands)
    runs = runs if runs and isinstance(runs[0], list) else [runs]
    names = [name for name, _ in runs[0]]
    return [(name, statistics.median(run[i][1] for run in runs) * 1e-3)
            for i, name in enumerate(names)]


def compare(
    contenders: dict[str, Callable[..., jax.Array]],
    operand_sets: Sequence[tuple[jax.Array, ...]],
    *,
    rounds: int = 5,
    iterations: int = 3,
) -> dict[str, Timing]:
    """Time of one product for every contender, measured the same way in one run.

    Each contender evaluates every operand set (rotated over distinct buffers, so repeated
    calls do not run out of L2) inside one jit. Rounds alternate between contenders, the order
    rotating each round, so clock and temperature drift hit all of them alike. On a GPU the
    time is the sum of the durations of the kernels each call launches (CUPTI); elsewhere it is
    wall time. Returns the median per product and half the min-max spread over all samples.
    """
    sets = list(operand_sets)
    jitted = {
        name: jax.jit(lambda s, fn=fn: [fn(*ops) for ops in s]) for name, fn in contenders.items()
    }
    for fn in jitted.values():  # compile and warm up
        jax.block_until_ready(fn(sets))
    measure = _cupti_measure() if timing_method() == "cupti" else None
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = jitted[name]
            if measure is not None:
                _, per_iter_ms = measure(fn, iterations=iterations)(sets)
                per_iter_ms = per_iter_ms if isinstance(per_iter_ms, list) else [per_iter_ms]
                samples[name] += [ms * 1e-3 / len(sets) for ms in per_iter_ms]
            else:
                for _ in range(iterations):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(sets))
                    samples[name].append((time.perf_counter() - start) / len(sets))
    return {
        name: Timing(statistics.median(s), (max(s) - min(s)) / 2, len(s))
        for name, s in samples.items()
    }
