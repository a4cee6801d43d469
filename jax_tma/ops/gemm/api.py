"""``jax_tma.dot_general`` and ``jax_tma.matmul``: ``lax.dot_general`` and ``jnp.matmul`` with
their results, dtypes and errors. Operands of one 16-bit float type (bf16 or fp16) with an
output of that type or fp32, and a ``precision`` that asks for what the kernel computes
(``primitive.kernel_precision``), bind the ``jax_tma_dot_general`` primitive (primitive.py);
everything else goes straight to ``lax.dot_general``.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
# NOTE: lax.dot_general's own canonical precision (it reads jax_default_matmul_precision for
# None) and the weak-typed convert that jnp uses; both present in jax 0.10 and 0.11.
from jax._src.lax.lax import _convert_element_type, canonicalize_precision

from jax_tma import _ext
from jax_tma._core.keywords import preferred_type
from jax_tma.ops.gemm import autotune
from jax_tma.ops.gemm.config import GemmConfig
from jax_tma.ops.gemm.plan import normalize
from jax_tma.ops.gemm.primitive import (_kernel_input_dtype, config_for, dot_general_p,
                                        kernel_route)


def _is_arraylike(x) -> bool:
    """What lax and jnp take as an operand: arrays, numpy scalars, Python numbers."""
    return (isinstance(x, (jax.Array, np.ndarray, np.generic, bool, numbers.Number))
            or hasattr(x, "__jax_array__"))


def _weak_as(out: jax.Array, expected) -> jax.Array:
    """`out` weakly typed where the reference's result is (lax and jnp keep weak types)."""
    if getattr(expected, "weak_type", False):
        return _convert_element_type(out, jnp.dtype(out.dtype), weak_type=True)
    return out


def dot_general(lhs: Any, rhs: Any, dimension_numbers, precision=None,
                preferred_element_type=None, *, out_sharding=None,
                config: GemmConfig | None = None) -> jax.Array:
    """``jax.lax.dot_general`` on the Hopper TMA kernel where it applies.

    Same signature, results, dtypes (weak types included) and errors as ``lax.dot_general``,
    so it can be passed as ``dot_general=`` to ``flax.linen.Dense``, ``DenseGeneral``,
    ``flax.nnx.Linear`` and ``LinearGeneral``. bf16 or fp16 operands of one dtype with an output
    of that dtype or fp32 run the kernel (fp32 accumulation), as do operands of two types that
    lax converts to a bf16 or fp16 output type before its dot. `precision` must ask for what
    the kernel computes (``kernel_precision``: None, any ``lax.Precision``, the DEFAULT preset,
    BF16_BF16_F32 on bf16, F16_F16_F32 on fp16); other algorithms run ``lax.dot_general``.
    Operands are read in place when each one's batch, free and contracting dimensions are runs
    of adjacent axes (rows that are not 16-byte multiples are padded once); otherwise one
    operand, the smaller, is transposed first (two contracting dims in opposite orders, say).
    Products larger than the kernel takes (m, n, k or batch past 2^31 - 1, more than
    config.MAX_WORK_UNITS tiles) and calls with `out_sharding` run ``lax.dot_general``.

    Args:
      lhs, rhs: arrays.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``, or
        None for an un-batched matrix/vector product, as for ``lax.dot_general``.
      precision, preferred_element_type, out_sharding: as for ``lax.dot_general``.
      config: a ``GemmConfig`` for this product (not for the products of its gradient or of
        ``vmap``, which the heuristic configures); a ValueError names the shapes if it cannot
        compute it.
    """
    config = GemmConfig.coerce(config, "jax_tma.dot_general")

    def reference(x, y):
        return lax.dot_general(x, y, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type,
                               out_sharding=out_sharding)

    if not (_is_arraylike(lhs) and _is_arraylike(rhs)):
        return reference(lhs, rhs)  # lax's TypeError
    expected = jax.eval_shape(reference, lhs, rhs)  # lax's errors, lax's result type
    _ext.warn_if_unavailable()
    out_dtype = jnp.dtype(expected.dtype)
    canonical = canonicalize_precision(precision)  # hashable: lax refused anything else
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    in_dtype = _kernel_input_dtype(lhs.dtype, rhs.dtype, out_dtype, canonical)
    if out_sharding is not None or math.prod(expected.shape) == 0 or in_dtype is None:
        return reference(lhs, rhs)
    lhs, rhs = lhs.astype(in_dtype), rhs.astype(in_dtype)  # no-ops but for lax's conversions
    dims = normalize(dimension_numbers, lhs.ndim, rhs.ndim)
    if config is not None:
        route = kernel_route(lhs, rhs, dims, out_dtype, canonical)
        if route is not None:
            config_for(route.plan, out_dtype, config)
    elif autotune.enabled():
        # Products the rule leaves to XLA are tuned too: the measurement decides for them.
        route = kernel_route(lhs, rhs, dims, out_dtype, canonical)
        if route is not None and _ext.kernel_status().available:
            autotune.tune_missing(lhs, rhs, dims, route.plan, out_dtype, precision,
                                  preferred_element_type)
    out = dot_general_p.bind(lhs, rhs, dimension_numbers=dims, out_dtype=out_dtype,
                             precision=canonical, config=config, local=False)
    return _weak_as(out, expected)


def matmul(a: Any, b: Any, *, precision=None, preferred_element_type=None, out_sharding=None,
           out_dtype: Any = None, config: GemmConfig | None = None) -> jax.Array:
    """Matrix product with ``jnp.matmul`` semantics, on the Hopper TMA kernel where it applies.

    Args:
      a: array of shape [..., M, K] or [K] (any dtype ``jnp.matmul`` accepts).
      b: array of shape [..., K, N] or [K].
      precision, preferred_element_type, out_sharding: as for ``jnp.matmul``.
      out_dtype: the same as `preferred_element_type` (both given: they must agree).
      config: a ``GemmConfig`` to force a kernel tile configuration; by default a heuristic
        picks one. Ignored where the kernel does not apply.

    Returns:
      ``jnp.matmul(a, b, precision=precision, preferred_element_type=...)``. bf16/fp16
      operands run the kernel (fp32 accumulation) through ``dot_general``, with its rules for
      precisions and operand types: batch dims of equal shape become the kernel's batch axis,
      batch dims of `a` alone fold into M; other broadcasts, and calls with `out_sharding`,
      run ``jnp.matmul``. Errors are ``jnp.matmul``'s.
    """
    config = GemmConfig.coerce(config, "jax_tma.matmul")
    preferred_element_type = preferred_type("jax_tma.matmul", preferred_element_type, out_dtype)
    reference = functools.partial(jnp.matmul, precision=precision,
                                  preferred_element_type=preferred_element_type,
                                  out_sharding=out_sharding)
    if not (_is_arraylike(a) and _is_arraylike(b)):
        return reference(a, b)  # jnp's TypeError
    expected = jax.eval_shape(reference, a, b)
    _ext.warn_if_unavailable()
    a, b = jnp.asarray(a), jnp.asarray(b)
    out_type = jnp.dtype(expected.dtype)
    if (out_sharding is not None or _kernel_input_dtype(
            a.dtype, b.dtype, out_type, canonicalize_precision(precision)) is None):
        return reference(a, b)
    kw = dict(precision=precision, preferred_element_type=out_type, config=config)
    if a.ndim == 1 and b.ndim == 1:
        out = dot_general(a, b, (((0,), (0,)), ((), ())), **kw)
    elif b.ndim == 1:
        out = dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), **kw)
    elif a.ndim == 1:
        out = dot_general(a, b, (((0,), (b.ndim - 2,)), ((), ())), **kw)
    elif b.ndim == 2:  # a's batch dims fold into M
        out = dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), **kw)
    elif a.shape[:-2] == b.shape[:-2]:
        batch = tuple(range(a.ndim - 2))
        out = dot_general(a, b, (((a.ndim - 1,), (b.ndim - 2,)), (batch, batch)), **kw)
    elif a.ndim == 2 and b.ndim == 3:
        # [M, K] @ [B, K, N]: the kernel broadcasts a over b's batch and writes [M, B, N].
        out = jnp.moveaxis(dot_general(a, b, (((1,), (1,)), ((), ())), **kw), 1, 0)
    else:
        return reference(a, b)
    if getattr(out, "weak_type", False) != getattr(expected, "weak_type", False):
        out = _convert_element_type(out, out_type, weak_type=bool(expected.weak_type))
    return out
