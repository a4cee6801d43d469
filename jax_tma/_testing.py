"""Internal entry points for tests; not part of the public API.

The primitive test kernels (csrc/testing/) are called through ``jax_tma_test_*`` FFI
targets. ``gemm_into`` runs the GEMM kernel writing into a caller-provided buffer (aliased to the
output), so tests can poison the output first and prove that every element was written.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from jax_tma import gemm


@functools.partial(jax.jit, static_argnames=("config",))
def gemm_into(a: jax.Array, b: jax.Array, d_init: jax.Array, config: gemm.GemmConfig | None = None):
    """Kernel result of ``a @ b`` written over ``d_init`` (shape [M, N], the output dtype)."""
    return gemm._kernel_call(
        a, b, out_dtype=d_init.dtype, config=config, target=gemm.KERNEL_TARGET + "_into", into=d_init
    )


# ---------------------------------------------------------------- primitive test kernels

# Default budget for bounded waits inside test kernels: about a second at Hopper clocks.
TIMEOUT_CYCLES = 2**31


def _i64(v) -> np.int64:
    return np.int64(v)


def tma_round_trip(x: jax.Array, box: tuple[int, ...], swizzle: int = 0,
                   timeout_cycles: int = TIMEOUT_CYCLES):
    """TMA-loads every `box` of x, returns (x stored back by TMA, the shared-memory image of
    each box as uint8 [boxes, box_bytes], timeout count)."""
    boxes = math.prod(-(-d // b) for d, b in zip(x.shape, box)) if len(box) == x.ndim else 1
    box_bytes = math.prod(box) * x.dtype.itemsize
    out = (
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct((boxes, box_bytes), np.uint8),
        jax.ShapeDtypeStruct((1,), np.int32),
    )
    return jax.ffi.ffi_call("jax_tma_test_tma_round_trip", out)(
        x, box=np.asarray(box, np.int64), swizzle=_i64(swizzle), timeout_cycles=_i64(timeout_cycles)
    )


def tma_reduce_add(x: jax.Array, y: jax.Array, box: tuple[int, int],
                   timeout_cycles: int = TIMEOUT_CYCLES):
    """y + x computed by TMA reduce-add stores of x's boxes into (a copy of) y."""
    out = (jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct((1,), np.int32))
    return jax.ffi.ffi_call("jax_tma_test_tma_reduce_add", out, input_output_aliases={1: 0})(
        x, y, box=np.asarray(box, np.int64), timeout_cycles=_i64(timeout_cycles)
    )


def tma_multicast(x: jax.Array, cluster_m: int, cluster_n: int, issuers: int, mask: int = 0,
                  mode: int = 0, extra_tx_bytes: int = 0, timeout_cycles: int = TIMEOUT_CYCLES):
    """Runs one cluster; returns (uint8 [cta, slot, box_bytes] shared-memory dumps, per-CTA
    timeout flags). See csrc/testing/primitives_test.h for the protocol."""
    size = cluster_m * cluster_n
    box_bytes = x.shape[0] // size * x.shape[1] * x.dtype.itemsize
    out = (
        jax.ShapeDtypeStruct((size, size, box_bytes), np.uint8),
        jax.ShapeDtypeStruct((size,), np.int32),
    )
    return jax.ffi.ffi_call("jax_tma_test_tma_multicast", out)(
        x, cluster_m=_i64(cluster_m), cluster_n=_i64(cluster_n), issuers=_i64(issuers),
        mask=_i64(mask), mode=_i64(mode), extra_tx_bytes=_i64(extra_tx_bytes),
        timeout_cycles=_i64(timeout_cycles),
    )


def pipeline_phases(stages: int, consumers: int, iterations: int,
                    timeout_cycles: int = TIMEOUT_CYCLES):
    """Producer -> `consumers` warps over a PipelineAsync ring; returns (values each consumer
    read per iteration [consumers, iterations], timeout count)."""
    out = (
        jax.ShapeDtypeStruct((consumers, iterations), np.int32),
        jax.ShapeDtypeStruct((1,), np.int32),
    )
    return jax.ffi.ffi_call("jax_tma_test_pipeline_phases", out)(
        stages=_i64(stages), timeout_cycles=_i64(timeout_cycles)
    )
