"""Sharding of ``jax_tma.dot_general``: ``custom_partitioning`` with a Shardy rule.

The product is wrapped in ``custom_partitioning`` on every platform (on one device it is
inlined), so the partitioner never has to gather an operand the sharding does not ask for:

- batch, M (lhs free) and N (rhs free) dimensions keep the operands' sharding: every device
  computes its own block of the output, with no communication;
- a sharded contracting dimension is contracted locally and the partial products are summed
  with ``psum`` (in fp32 when the output is 16-bit), or with ``psum_scatter`` along an output
  dimension that the requested output sharding splits over the same mesh axes;
- a mesh axis is used once: batch dims claim it first, then M, N and K; an operand dimension
  whose size the mesh axes do not divide is not sharded.

Shardy (the default partitioner) propagates through the einsum-like rule from
``sharding_rule``; the legacy partitioner through ``infer_sharding_from_operands``. Both end in
``partition``, which chooses the shardings above and the per-device body.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_tma._core.sharding import Axes, AxisClaims, spec_of
from jax_tma.ops.gemm.plan import free_axes

@dataclasses.dataclass(frozen=True)
class _Choice:
    lhs: tuple[Axes, ...]
    rhs: tuple[Axes, ...]
    out: tuple[Axes, ...]
    reduce_axes: Axes  # mesh axes that split the contracting dims

    def spec(self, dims: tuple[Axes, ...]) -> PartitionSpec:
        return PartitionSpec(*(d if len(d) > 1 else (d[0] if d else None) for d in dims))


def _choose(mesh, lhs_shape, rhs_shape, lhs_spec, rhs_spec, dimension_numbers) -> _Choice:
    """Shardings of both operands and the output for the operands' current shardings."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf, rf = free_axes(len(lhs_shape), lc, lb), free_axes(len(rhs_shape), rc, rb)
    claim = AxisClaims(mesh)

    batch = [claim(lhs_spec[i] or rhs_spec[j], lhs_shape[i]) for i, j in zip(lb, rb)]
    m = [claim(lhs_spec[i], lhs_shape[i]) for i in lf]
    n = [claim(rhs_spec[j], rhs_shape[j]) for j in rf]
    k = [claim(lhs_spec[i] or rhs_spec[j], lhs_shape[i]) for i, j in zip(lc, rc)]

    lhs_out, rhs_out = [()] * len(lhs_shape), [()] * len(rhs_shape)
    for (i, j), axes in zip(zip(lb, rb), batch):
        lhs_out[i] = rhs_out[j] = axes
    for (i, j), axes in zip(zip(lc, rc), k):
        lhs_out[i] = rhs_out[j] = axes
    for i, axes in zip(lf, m):
        lhs_out[i] = axes
    for j, axes in zip(rf, n):
        rhs_out[j] = axes
    reduce_axes = tuple(a for axes in k for a in axes)
    return _Choice(tuple(lhs_out), tuple(rhs_out), (*batch, *m, *n), reduce_axes)


def _scatter_plan(mesh, choice: _Choice, requested: list[Axes], out_shape):
    """(output dim, mesh axes) pairs to reduce-scatter instead of all-reduce: output dims the
    requested sharding splits over contracting axes, where the chosen one does not."""
    plan, left = [], set(choice.reduce_axes)
    for d, want in enumerate(requested):
        if (want and not choice.out[d] and set(want) <= left
                and out_shape[d] % math.prod(mesh.shape[a] for a in want) == 0):
            plan.append((d, want))
            left -= set(want)
    return plan, tuple(a for a in choice.reduce_axes if a in left)


def _choose_for(mesh, arg_shapes, dimension_numbers) -> _Choice:
    lhs, rhs = arg_shapes
    return _choose(mesh, lhs.shape, rhs.shape, spec_of(lhs.sharding, len(lhs.shape)),
                   spec_of(rhs.sharding, len(rhs.shape)), dimension_numbers)


def _infer(local_dot, dimension_numbers, out_dtype, config, mesh, arg_shapes, result_shape):
    del local_dot, out_dtype, config, result_shape
    choice = _choose_for(mesh, arg_shapes, dimension_numbers)
    return NamedSharding(mesh, choice.spec(choice.out))


def _partition(local_dot, dimension_numbers, out_dtype, config, mesh, arg_shapes, result_shape):
    choice = _choose_for(mesh, arg_shapes, dimension_numbers)
    requested = spec_of(result_shape.sharding, len(result_shape.shape))
    scatters, psum_axes = _scatter_plan(mesh, choice, requested, result_shape.shape)
    out_dims = list(choice.out)
    for d, axes in scatters:
        out_dims[d] = axes
    sharded = any(choice.lhs) or any(choice.rhs)
    local_config = None if sharded else config
    out_dtype = jnp.dtype(out_dtype)
    # Partial products are summed in fp32 when the output is narrower.
    acc_dtype = (jnp.dtype(jnp.float32) if choice.reduce_axes and out_dtype.itemsize < 4
                 else out_dtype)

    def per_device(x, y):
        out = local_dot(x, y, dimension_numbers, acc_dtype, local_config)
        for d, axes in scatters:
            out = lax.psum_scatter(out, axes, scatter_dimension=d, tiled=True)
        if psum_axes:
            out = lax.psum(out, psum_axes)
        return out.astype(out_dtype)

    arg_shardings = (NamedSharding(mesh, choice.spec(choice.lhs)),
                     NamedSharding(mesh, choice.spec(choice.rhs)))
    return mesh, per_device, NamedSharding(mesh, choice.spec(tuple(out_dims))), arg_shardings


def _sharding_rule(local_dot, dimension_numbers, out_dtype, config, mesh, operand_types,
                   result_types):
    """Einsum-like factors: b<i> batch, m<i> lhs free, n<i> rhs free, k<i> contracting."""
    del local_dot, out_dtype, config, mesh, result_types
    (lc, rc), (lb, rb) = dimension_numbers
    lhs_rank, rhs_rank = (len(t.shape) for t in operand_types)
    lhs, rhs = [""] * lhs_rank, [""] * rhs_rank
    for i, (a, b) in enumerate(zip(lb, rb)):
        lhs[a] = rhs[b] = f"b{i}"
    for i, (a, b) in enumerate(zip(lc, rc)):
        lhs[a] = rhs[b] = f"k{i}"
    lf, rf = free_axes(lhs_rank, lc, lb), free_axes(rhs_rank, rc, rb)
    for i, a in enumerate(lf):
        lhs[a] = f"m{i}"
    for i, b in enumerate(rf):
        rhs[b] = f"n{i}"
    out = [f"b{i}" for i in range(len(lb))] + [lhs[a] for a in lf] + [rhs[b] for b in rf]
    return f"{' '.join(lhs)}, {' '.join(rhs)} -> {' '.join(out)}"


@functools.partial(custom_partitioning, static_argnums=(2, 3, 4, 5))
def _partitioned(lhs, rhs, local_dot, dimension_numbers, out_dtype, config):
    return local_dot(lhs, rhs, dimension_numbers, out_dtype, config)


_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer,
    sharding_rule=_sharding_rule,
)


def partitioned_dot(lhs: jax.Array, rhs: jax.Array, *, local_dot: Callable, dimension_numbers,
                    out_dtype, config) -> jax.Array:
    """``local_dot(lhs, rhs, dimension_numbers, out_dtype, config)`` under the partitioning
    rules above: each device runs local_dot on its shards."""
    return _partitioned(lhs, rhs, local_dot, dimension_numbers, jnp.dtype(out_dtype), config)
