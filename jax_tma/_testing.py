"""Internal entry points for tests; not part of the public API.

Importing it registers the test extension's FFI targets (``_ext.register_testing``); where that
extension is missing (an install that is not editable leaves it out) ``TESTING_ERROR`` says why
and every call below raises RuntimeError with it. The primitive test kernels (csrc/testing/) are
called through ``jax_tma_test_*`` FFI targets. ``gemm_poisoned`` runs the GEMM kernel over
NaN-filled output buffers, so tests prove that every element was written.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tma import _ext
from jax_tma.ops.gemm import primitive as gemm
from jax_tma.ops.gemm.config import GemmConfig

# None once the test-only targets are registered, otherwise why not.
TESTING_ERROR: str | None = _ext.register_testing()


def _require_testing() -> None:
    if TESTING_ERROR is not None:
        raise RuntimeError(
            f"jax_tma: the test-only FFI targets are not registered: {TESTING_ERROR}")


def _test_call(target: str, out, **kwargs):
    """jax.ffi.ffi_call of a ``jax_tma_test_*`` target, refused here (not in XLA) without it."""
    _require_testing()
    return jax.ffi.ffi_call(target, out, **kwargs)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "dimension_numbers"))
def gemm_poisoned(a: jax.Array, b: jax.Array, out_dtype, config: GemmConfig | None = None,
                  dimension_numbers=(((1,), (0,)), ((), ()))):
    """Kernel result of ``dot_general(a, b, dimension_numbers)`` as out_dtype (by default
    ``a @ b``), written over NaN-filled buffers (the output, or the split-K partial products),
    so that any element the kernel skips shows up as NaN. Operands the kernel cannot read in
    place are transposed first, as the lowering does (gemm.kernel_route). Raises ValueError
    when the kernel cannot compute the product, or `config` cannot."""
    _require_testing()
    out_dtype = jnp.dtype(out_dtype)
    route = gemm.kernel_route(a, b, dimension_numbers, out_dtype)
    if route is None:
        raise ValueError(f"jax_tma: no kernel plan for {a.shape} x {b.shape}, {dimension_numbers}")
    return gemm._kernel_call(a, b, plan=route.plan, dimension_numbers=dimension_numbers,
                             out_dtype=out_dtype, config=config, poison=True, route=route)


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
    return _test_call("jax_tma_test_tma_round_trip", out)(
        x, box=np.asarray(box, np.int64), swizzle=_i64(swizzle), timeout_cycles=_i64(timeout_cycles)
    )


def tma_reduce_add(x: jax.Array, y: jax.Array, box: tuple[int, int],
                   timeout_cycles: int = TIMEOUT_CYCLES):
    """y + x computed by TMA reduce-add stores of x's boxes into (a copy of) y."""
    out = (jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct((1,), np.int32))
    return _test_call("jax_tma_test_tma_reduce_add", out, input_output_aliases={1: 0})(
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
    return _test_call("jax_tma_test_tma_multicast", out)(
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
    return _test_call("jax_tma_test_pipeline_phases", out)(
        stages=_i64(stages), timeout_cycles=_i64(timeout_cycles)
    )


def pair_math(a: jax.Array, b: jax.Array, half: bool):
    """The fused epilogues' packed 16-bit sums and products (add_pairs, mul_pairs): a and b
    uint32 [n], each word two bf16 values (fp16 where `half`); returns (sums, products), uint32
    [n] in the same packing."""
    out = (jax.ShapeDtypeStruct(a.shape, np.uint32), jax.ShapeDtypeStruct(a.shape, np.uint32))
    return _test_call("jax_tma_test_pair_math", out)(a, b, half=_i64(int(half)))


def tensormap_replace(x: jax.Array, groups: np.ndarray, template: tuple[int, int, int],
                      box: tuple[int, int], timeout_cycles: int = TIMEOUT_CYCLES):
    """Tensor maps edited on the device: CTA g copies a template map over the flat buffer x
    (template = (rows, cols, row stride) in elements) into its own 128-byte slot of a workspace,
    replaces address, dims and row stride with groups[g] = (element offset, rows, cols, row
    stride), and TMA-loads box (rows, cols) at (0, 0) through it. Returns (uint8 [G, box bytes]
    shared-memory images, uint8 [G, 128] edited maps, timeout count)."""
    groups = np.asarray(groups)
    if groups.ndim != 2 or groups.shape[1] != 4:
        raise ValueError(f"groups must be [G, 4], got shape {groups.shape}")
    itemsize = x.dtype.itemsize
    for g, (offset, rows, cols, stride) in enumerate(groups.tolist()):
        # The device trusts these: TMA needs 16-byte aligned addresses and strides.
        if offset * itemsize % 16 or stride * itemsize % 16 or min(rows, cols) < 1 or stride < cols:
            raise ValueError(f"group {g} = {(offset, rows, cols, stride)} is not a valid TMA view")
        if offset + (rows - 1) * stride + cols > x.size:
            raise ValueError(
                f"group {g} = {(offset, rows, cols, stride)} reaches past x ({x.size})")
    box_bytes = math.prod(box) * itemsize
    out = (
        jax.ShapeDtypeStruct((len(groups), box_bytes), np.uint8),
        jax.ShapeDtypeStruct((len(groups), 128), np.uint8),
        jax.ShapeDtypeStruct((1,), np.int32),
    )
    return _test_call("jax_tma_test_tensormap_replace", out)(
        x.reshape(-1), jnp.asarray(groups, np.int32), template=np.asarray(template, np.int64),
        box=np.asarray(box, np.int64), timeout_cycles=_i64(timeout_cycles),
    )


CP_ASYNC_CHUNK_BYTES = 1024  # csrc/testing/primitives_test.h kCpAsyncChunkBytes


def cp_async_pipeline(src: jax.Array, stages: int, consumers: int, full_arrivals: int = 32,
                      timeout_cycles: int = TIMEOUT_CYCLES):
    """Copies the bytes of src through a PipelineCpAsync ring (one producer warp, `consumers`
    warps); returns (uint8 output padded with zeros to whole 1 KiB chunks, timeout count)."""
    padded = -(-src.size * src.dtype.itemsize // CP_ASYNC_CHUNK_BYTES) * CP_ASYNC_CHUNK_BYTES
    out = (jax.ShapeDtypeStruct((padded,), np.uint8), jax.ShapeDtypeStruct((1,), np.int32))
    return _test_call("jax_tma_test_cp_async_pipeline", out)(
        src, stages=_i64(stages), consumers=_i64(consumers), full_arrivals=_i64(full_arrivals),
        timeout_cycles=_i64(timeout_cycles),
    )


def dsmem_ring(src: jax.Array, extra_tx_bytes: int = 0, timeout_cycles: int = TIMEOUT_CYCLES):
    """One cluster of src.shape[0] (2 or 4) CTAs; CTA r stores src[r] (uint32) into the shared
    memory of CTA (r + 1) % size with st.async. Returns (what each CTA received, uint32
    [size, words], timeout count)."""
    out = (jax.ShapeDtypeStruct(src.shape, np.uint32), jax.ShapeDtypeStruct((1,), np.int32))
    return _test_call("jax_tma_test_dsmem_ring", out)(
        src, extra_tx_bytes=_i64(extra_tx_bytes), timeout_cycles=_i64(timeout_cycles)
    )


def tma_multicast_pipeline(x: jax.Array, y: jax.Array, stages: int, consumers: int,
                           slow_cta: int = -1, extra_empty_arrivals: int = 0,
                           timeout_cycles: int = TIMEOUT_CYCLES):
    """PipelineTmaAsync across one cluster. x: [iterations, size, slice_rows, cols] shared tiles
    (CTA r multicasts slice r), y: [size, iterations, y_rows, cols] private tiles. Returns
    (out uint8 [size, iterations, stage bytes] = x[k] then y[r, k] as each CTA's consumers saw
    the stage, releases aimed at each CTA in total and when its producer tail returned, int32
    [size] each, timeout count)."""
    iterations, size, slice_rows, cols = x.shape
    y_rows = y.shape[2]
    if y.shape != (size, iterations, y_rows, cols) or x.dtype != y.dtype:
        raise ValueError(f"y must be {x.dtype} [{size}, {iterations}, rows, {cols}], got "
                         f"{y.dtype} {y.shape}")
    stage_bytes = (size * slice_rows + y_rows) * cols * x.dtype.itemsize
    out = (
        jax.ShapeDtypeStruct((size, iterations, stage_bytes), np.uint8),
        jax.ShapeDtypeStruct((size,), np.int32),
        jax.ShapeDtypeStruct((size,), np.int32),
        jax.ShapeDtypeStruct((1,), np.int32),
    )
    return _test_call("jax_tma_test_tma_multicast_pipeline", out)(
        x.reshape(-1, cols), y.reshape(-1, cols), stages=_i64(stages), cluster_size=_i64(size),
        consumers=_i64(consumers), iterations=_i64(iterations), slice_rows=_i64(slice_rows),
        y_rows=_i64(y_rows), slow_cta=_i64(slow_cta),
        extra_empty_arrivals=_i64(extra_empty_arrivals), timeout_cycles=_i64(timeout_cycles),
    )


STORE_TILE = (32, 32)  # csrc/testing/primitives_test.h kStoreTileRows, kStoreTileCols


def tma_store_pipeline(stages: int, iterations: int):
    """PipelineTmaStore ring: int32 [iterations * 32, 32], tile k element i = k * 65536 + i."""
    rows, cols = STORE_TILE
    out = jax.ShapeDtypeStruct((iterations * rows, cols), np.int32)
    return _test_call("jax_tma_test_tma_store_pipeline", out)(stages=_i64(stages))


def named_barrier_ping_pong(iterations: int):
    """Two warpgroups alternate writing and reading a buffer through named barriers; returns
    int32 [iterations, 128]: what the reader's thread t saw at iteration k, which must be
    k * 1000 + (t + 37 + k) % 128."""
    out = jax.ShapeDtypeStruct((iterations, 128), np.int32)
    return _test_call("jax_tma_test_named_barrier_ping_pong", out)()


def ordered_barrier(groups: int, passes: int, timeout_cycles: int = TIMEOUT_CYCLES):
    """OrderedBarrier<groups, 2>: returns (final section counters int32 [2], per-section log of
    group ids in entry order int32 [2, groups * passes], timeout count)."""
    out = (
        jax.ShapeDtypeStruct((2,), np.int32),
        jax.ShapeDtypeStruct((2, groups * passes), np.int32),
        jax.ShapeDtypeStruct((1,), np.int32),
    )
    return _test_call("jax_tma_test_ordered_barrier", out)(
        groups=_i64(groups), timeout_cycles=_i64(timeout_cycles)
    )


# ---------------------------------------------------------------- copy benchmark kernels


def tma_copy(x: jax.Array, stages: int = 12, ctas_per_sm: int = 1) -> jax.Array:
    """x copied by the persistent TMA load -> store kernel (any dtype, rank >= 1, rows a
    multiple of 16 bytes)."""
    return _test_call("jax_tma_test_tma_copy", jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, stages=_i64(stages), ctas_per_sm=_i64(ctas_per_sm)
    )


def d2d_copy(x: jax.Array) -> jax.Array:
    """x copied by cudaMemcpyAsync device to device (the bandwidth baseline)."""
    return _test_call("jax_tma_test_d2d_copy", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
