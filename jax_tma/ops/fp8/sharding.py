"""Sharding of the FP8 product primitive (jax_tma/ops/fp8/primitive.py): ``custom_partitioning``
with a Shardy rule.

Operands a [M, K], b [N, K], then where present sa [Kb, M], sb [Kb, Nb] (block scales), the row
scale ([] or [M]), the column scale ([] or [N]) and the bias [N]; the result out [M, N].

- M and N keep the operands' sharding (rows of a, sa and the row scale; rows of b, the column
  blocks of sb, the column scale and the bias): every device computes its block of the output.
  With B's block scales, N is split only on whole 128-column blocks.
- A sharded K is contracted locally (its K slices of 128 and their block scales together, so K
  is split only on whole slices) into fp32 partial products, summed with ``psum``; the bias is
  added after the sum, and the result rounded to the output type once.
- A mesh axis is used once (M first, then N, then K); a dimension the mesh axes do not divide
  evenly (in whole blocks where the scales need it) is not sharded.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jax_tma._core.sharding import AxisClaims, Params, one, partitioned_call, spec_of

SCALE_BLOCK = 128


def _names(params) -> list[str]:
    names = ["a", "b"]
    if params["has_sa"]:
        names.append("sa")
    if params["has_sb"]:
        names.append("sb")
    if params["row_scale"] != "none":
        names.append("row_" + params["row_scale"])
    if params["col_scale"] != "none":
        names.append("col_" + params["col_scale"])
    if params["has_bias"]:
        names.append("bias")
    return names


def _choose(mesh, params, arg_shapes):
    """(operand shardings, output sharding, mesh axes splitting K)."""
    names = _names(params)
    specs = [spec_of(s.sharding, len(s.shape)) for s in arg_shapes]
    (m, k), (n, _) = arg_shapes[0].shape, arg_shapes[1].shape
    claim = AxisClaims(mesh)

    blocks = params["has_sa"] or params["has_sb"]
    m_axes = claim(specs[0][0], m)
    n_axes = claim(specs[1][0], n, SCALE_BLOCK if params["has_sb"] else 1)
    k_axes = claim(specs[0][1] or specs[1][1], k, SCALE_BLOCK if blocks else 1)
    layout = {"a": (m_axes, k_axes), "b": (n_axes, k_axes), "sa": (k_axes, m_axes),
              "sb": (k_axes, n_axes), "row_scalar": (), "row_vector": (m_axes,),
              "col_scalar": (), "col_vector": (n_axes,), "bias": (n_axes,)}
    shardings = [NamedSharding(mesh, PartitionSpec(*map(one, layout[name]))) for name in names]
    out = NamedSharding(mesh, PartitionSpec(one(m_axes), one(n_axes)))
    return shardings, out, k_axes


def _infer(local_op, params, mesh, arg_shapes, result_shape):
    del local_op, result_shape
    return _choose(mesh, params, arg_shapes)[1]


def _partition(local_op, params, mesh, arg_shapes, result_shape):
    del result_shape
    args, out, k_axes = _choose(mesh, params, arg_shapes)
    sharded = any(s.spec != PartitionSpec(*([None] * len(s.spec))) for s in args)
    local = dict(params, config=None) if sharded else dict(params)
    out_dtype = jnp.dtype(params["out_dtype"])
    if k_axes:  # fp32 partial products; the bias once, after their sum
        local.update(out_dtype=jnp.dtype(jnp.float32), has_bias=False)

    def per_device(*operands):
        if not k_axes:
            return local_op(*operands, **local)
        body = operands[:-1] if params["has_bias"] else operands
        partial = lax.psum(local_op(*body, **local), k_axes)
        if params["has_bias"]:
            partial = partial + operands[-1]
        return partial.astype(out_dtype)

    return mesh, per_device, out, tuple(args)


def _sharding_rule(local_op, params, mesh, operand_types, result_types):
    del local_op, mesh, result_types
    parts = {"a": "m k", "b": "n k", "sa": "kb m", "sb": "kb nb", "row_scalar": "",
             "row_vector": "m", "col_scalar": "", "col_vector": "n", "bias": "n"}
    rule = ", ".join(parts[name] for name in _names(params)[: len(operand_types)])
    return f"{rule} -> m n"


_partitioned = partitioned_call(partition=_partition, infer_sharding_from_operands=_infer,
                                sharding_rule=_sharding_rule, num_static=2)


def partitioned_fp8_dot(*operands, local_op: Callable, params: dict):
    """``local_op(*operands, **params)`` under the partitioning rules above."""
    params = Params.static(params)
    return _partitioned(local_op, params, *operands)
