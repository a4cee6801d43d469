"""Grouped GEMM for Mixture-of-Experts: ``jax_tma.ragged_dot``, ``ragged_dot_general`` and the
primitive behind them.

``ragged_dot(lhs, rhs, group_sizes)`` has the results, dtypes and errors of
``lax.ragged_dot``: ``lhs`` [M, K] holds the rows of G groups one after another (group g's
``group_sizes[g]`` rows after groups 0..g-1's), ``rhs`` [G, K, N] one weight matrix per group, and
row i of the [M, N] result is ``lhs[i] @ rhs[g]`` for the group g holding row i, zero for rows past
the last group. ``ragged_dot_general`` takes ``lax.ragged_dot_general``'s dimension numbers; the
forms below run the kernel, every other form runs ``lax.ragged_dot_general``.

  rows         lhs [M, K], rhs [G, K, N] or [G, N, K] (group dim 0), lhs ragged dim 0 -> [M, N]
  contraction  lhs [M, K], rhs [M, N], both contracted over their ragged dim 0 -> [G, K, N]
               (the weight gradient: out[g] = lhs[rows of g]^T @ rhs[rows of g])

The ``jax_tma_ragged_dot`` primitive holds a batch of such products (``vmap`` adds to it) and
carries its own rules: a JVP by bilinearity, transposes that bind the primitive again (the
gradient of lhs is the rows form against rhs read transposed in place; the gradient of rhs is
the contraction form), a batching rule, and sharding through ``custom_partitioning``
(primitive.py, sharding.py). It lowers to XLA everywhere and, on CUDA, to the
``jax_tma_ragged_dot_sm90`` kernel pair when the operands are bf16 or fp16 of one type
(csrc/contract/sm90_ragged_dot.h): group sizes are read on the device, never by the host.

Group sizes are clamped to [0, M], and the rows of the groups after the running sum reaches M are
cut off, as ``lax.ragged_dot`` computes them for sizes that sum to at most M. (``lax`` gives
meaning to negative sizes by overlapping groups; the kernel treats them as 0.)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_tma import _ext
from jax_tma.ops.gemm.config import KERNEL_INPUT_DTYPES, GemmConfig, kernel_output_dtypes
from jax_tma.ops.ragged.config import CONTRACTION, ROWS, check_config, widen_sizes
from jax_tma.ops.ragged.primitive import ragged_dot_p

# lax.ragged_dot's dimension numbers: lhs [M, K], rhs [G, K, N].
RAGGED_DOT_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])



def _kernel_precision(precision) -> bool:
    """Whether `precision` asks for what the kernel computes on 16-bit operands (fp32
    accumulation): None or lax.Precision values, alone or as a pair."""
    if precision is None:
        return True
    values = precision if isinstance(precision, (tuple, list)) else (precision,)
    return all(v is None or isinstance(v, lax.Precision) for v in values)


def _form(lhs_shape, rhs_shape, gs_shape, dims) -> tuple[str, bool] | None:
    """(mode, w_k_major) when ``ragged_dot_general`` with `dims` is one of the kernel's forms."""
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    lc, rc, lb, rb = (tuple(int(a) for a in v) for v in (lc, rc, lb, rb))
    ragged = tuple(int(a) for a in dims.lhs_ragged_dimensions)
    group = tuple(int(a) for a in dims.rhs_group_dimensions)
    if len(lhs_shape) != 2 or lb or rb or len(gs_shape) != 1 or ragged != (0,):
        return None
    if lc == (1,) and group == (0,) and len(rhs_shape) == 3 and rc in ((1,), (2,)):
        return ROWS, rc == (2,)
    if lc == (0,) and not group and len(rhs_shape) == 2 and rc == (0,):
        return CONTRACTION, False
    return None


def ragged_dot_general(lhs: Any, rhs: Any, group_sizes: Any,
                       ragged_dot_dimension_numbers: lax.RaggedDotDimensionNumbers,
                       precision=None, preferred_element_type=None, group_offset=None, *,
                       out_sharding=None, config: GemmConfig | None = None) -> jax.Array:
    """``lax.ragged_dot_general`` on the Hopper kernel where it applies.

    Same signature, results, dtypes and errors as ``lax.ragged_dot_general``. The rows form
    (lhs [M, K] ragged along M, rhs [G, K, N] or [G, N, K] grouped along dim 0) and the
    contraction form (lhs [M, K] and rhs [M, N] contracted along their ragged dim 0, result
    [G, K, N]) with bf16 or fp16 operands of one type and an output of that type or fp32 run the
    kernel (fp32 accumulation, one rounding at the store); other forms, dtypes, precisions
    other than ``lax.Precision`` values, ``group_offset`` and ``out_sharding`` run ``lax``.

    Args:
      lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision, preferred_element_type,
        group_offset, out_sharding: as for ``lax.ragged_dot_general``.
      config: a ``GemmConfig`` among ``RAGGED_CONFIGS`` for this product (not for those of its
        gradient or vmap); by default a heuristic picks one.
    """
    config = GemmConfig.coerce(config, "jax_tma.ragged_dot_general")
    if config is not None:
        check_config(config)
    if jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer):
        group_sizes = widen_sizes(group_sizes)  # int8 sizes summing past 127 wrap in lax
    reference = functools.partial(
        lax.ragged_dot_general, ragged_dot_dimension_numbers=ragged_dot_dimension_numbers,
        precision=precision, preferred_element_type=preferred_element_type,
        group_offset=group_offset, out_sharding=out_sharding)
    if group_offset is not None or out_sharding is not None:
        return reference(lhs, rhs, group_sizes)  # lax's results, or lax's errors as lax raises them
    expected = jax.eval_shape(reference, lhs, rhs, group_sizes)  # lax's errors and result type
    _ext.warn_if_unavailable()
    form = _form(np.shape(lhs), np.shape(rhs), np.shape(group_sizes),
                 ragged_dot_dimension_numbers)
    lhs_dtype, rhs_dtype = jnp.result_type(lhs), jnp.result_type(rhs)
    if (form is None or not _kernel_precision(precision) or math.prod(expected.shape) == 0
            or lhs_dtype != rhs_dtype or lhs_dtype not in KERNEL_INPUT_DTYPES
            or jnp.dtype(expected.dtype) not in kernel_output_dtypes(lhs_dtype)):
        return reference(lhs, rhs, group_sizes)
    mode, w_k_major = form
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    if math.prod(lhs.shape) == 0 or (mode == ROWS and math.prod(rhs.shape) == 0):
        return reference(lhs, rhs, group_sizes)
    out = ragged_dot_p.bind(lhs[None], rhs[None], group_sizes[None], mode=mode,
                            w_k_major=w_k_major, out_dtype=jnp.dtype(expected.dtype),
                            config=config, local=False)
    return out[0]


def ragged_dot(lhs: Any, rhs: Any, group_sizes: Any, precision=None,
               preferred_element_type=None, group_offset=None, *, out_sharding=None,
               config: GemmConfig | None = None) -> jax.Array:
    """``lax.ragged_dot`` on the Hopper kernel where it applies: grouped GEMM for MoE layers.

    Args:
      lhs: [M, K], the rows of every group one after another, sorted by group.
      rhs: [G, K, N], one matrix per group.
      group_sizes: [G] integers, rows per group (read on the device).
      precision, preferred_element_type, group_offset, out_sharding: as for ``lax.ragged_dot``.
      config: a ``GemmConfig`` among ``RAGGED_CONFIGS``; by default a heuristic picks one.

    Returns:
      [M, N]: ``lhs[i] @ rhs[g]`` for the group g holding row i; zero for rows past the last
      group. bf16 or fp16 operands of one type run the kernel (fp32 accumulation); everything
      else runs ``lax.ragged_dot``, with its results and errors.
    """
    return ragged_dot_general(lhs, rhs, group_sizes, RAGGED_DOT_DIMS, precision,
                              preferred_element_type, group_offset, out_sharding=out_sharding,
                              config=config)
