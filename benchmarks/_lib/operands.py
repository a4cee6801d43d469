"""GEMM operand sets for timing: enough distinct (a, b) pairs of a [B,]M,N,K product that
together they outgrow L2, so that a timed call rotating over them reads its operands from
HBM as a model's step would, not from the cache a previous call left warm. Layouts as in
bench_gemm: "NN", "NT", "TN", "TT" (a then b; T stores a as [K, M], b as [N, K])."""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_tma import _timing

from _lib.shapes import split_shape

L2_BYTES = 50 * 2**20
BUFFER_BUDGET = 4 * 2**30  # operand bytes allotted per shape


def operand_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of both operands of a [B,]M,N,K product."""
    batch, m, n, k = split_shape(shape)
    return math.prod(batch) * (m * k + k * n) * itemsize


def gemm_operand_sets(shape: tuple[int, ...], dtype, key, layout: str = "NN") -> list[tuple]:
    """(a, b) pairs of random `dtype` operands of a [B,]M,N,K product stored in `layout`, drawn
    from the jax PRNG `key`: twice L2 in all, at least 2 and at most 16 pairs, and no more
    than BUFFER_BUDGET bytes where the product is large."""
    batch, m, n, k = split_shape(shape)
    per_set = operand_bytes(shape, jnp.dtype(dtype).itemsize)
    count = max(2, math.ceil(2 * L2_BYTES / per_set))
    count = int(min(count, 16, max(2, BUFFER_BUDGET // per_set)))
    a_shape = (k, m) if layout[0] == "T" else (m, k)
    b_shape = (n, k) if layout[1] == "T" else (k, n)
    return _timing.random_operands(key, [(*batch, *a_shape), (*batch, *b_shape)], dtype, count)
