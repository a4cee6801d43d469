"""Sharding of the fused dense primitive (jax_tma/ops/dense/primitive.py):
``custom_partitioning`` with a Shardy rule.

Operands a [M, K], b [K, N] (or [N, K]), then b2 [K, N] (gated), bias [N], aux [M, N] (gated
gradient: [2, M, N]) where present; results out [M, N] and pre [M, N] (gated: [2, M, N]; gated
gradient: the second cotangent, [M, N]). M and N keep the operands' sharding (rows of a and aux,
columns of b, b2, bias and aux) and every device runs the fused kernel on its block, with no
communication. K is never split: the activation of a partial sum
is not the partial sum of the activation, so a sharded K is gathered (a Shardy "need
replication" factor) before the kernel runs.
"""

from __future__ import annotations

import math
from typing import Callable

from jax.sharding import NamedSharding, PartitionSpec

from jax_tma._core.sharding import Params, one, partitioned_call, spec_of


def _layout(params):
    """(b's N dim, names of the operands present in order)."""
    n_dim = 0 if params["b_k_major"] else 1
    names = ["a", "b"]
    if params["kind"] == "gated":
        names.append("b2")
    if params["has_bias"]:
        names.append("bias")
    if params["has_aux"]:
        names.append("aux2" if params["kind"] == "gated_gradient" else "aux")
    return n_dim, names


def _results(params) -> int:
    """How many results the primitive has: out, and the second where there is one."""
    return 2 if params["save_pre"] or params["kind"] == "gated_gradient" else 1


def _choose(mesh, params, arg_shapes):
    n_dim, names = _layout(params)
    specs = [spec_of(a.sharding, len(a.shape)) for a in arg_shapes]
    a_shape, b_shape = arg_shapes[0].shape, arg_shapes[1].shape

    def fits(axes, size):
        return bool(axes) and size % math.prod(mesh.shape[x] for x in axes) == 0

    m = specs[0][0] if fits(specs[0][0], a_shape[0]) else ()
    n = tuple(x for x in specs[1][n_dim] if x not in m)
    n = n if fits(n, b_shape[n_dim]) else ()
    shardings = []
    for name in names:
        if name == "a":
            spec = (m, ())
        elif name in ("b", "b2"):
            spec = [(), ()]
            spec[n_dim if name == "b" else 1] = n
        elif name == "bias":
            spec = (n,)
        elif name == "aux2":  # the gated gradient's two pre-activations
            spec = ((), m, n)
        else:  # aux
            spec = (m, n)
        shardings.append(NamedSharding(mesh, PartitionSpec(*map(one, spec))))
    out = NamedSharding(mesh, PartitionSpec(one(m), one(n)))
    pre = NamedSharding(mesh, PartitionSpec(None, one(m), one(n)) if params["kind"] == "gated"
                        else PartitionSpec(one(m), one(n)))
    return shardings, out, pre


def _infer(local_op, reference, params, mesh, arg_shapes, result_shape):
    del local_op, reference, result_shape
    _, out, pre = _choose(mesh, params, arg_shapes)
    return [out, pre][: _results(params)]


def _partition(local_op, reference, params, mesh, arg_shapes, result_shape):
    del reference, result_shape
    args, out, pre = _choose(mesh, params, arg_shapes)
    sharded = any(s.spec != PartitionSpec(*([None] * len(s.spec))) for s in args)
    local_params = dict(params, config=None) if sharded else params

    def per_device(*operands):
        return local_op(*operands, **local_params)

    results = [out, pre][: _results(params)]
    return mesh, per_device, results, tuple(args)


def _sharding_rule(local_op, reference, params, mesh, operand_types, result_types):
    del local_op, reference, mesh, result_types
    n_dim, names = _layout(params)
    b = "n k" if n_dim == 0 else "k n"
    parts = {"a": "m k", "b": b, "b2": "k n", "bias": "n", "aux": "m n", "aux2": "p m n"}
    rule = ", ".join(parts[name] for name in names[: len(operand_types)])
    outs = ["m n", "p m n" if params["kind"] == "gated" else "m n"][: _results(params)]
    return f"{rule} -> {', '.join(outs)}", dict(need_replication_factors=("k",))


_partitioned = partitioned_call(partition=_partition, infer_sharding_from_operands=_infer,
                                sharding_rule=_sharding_rule, num_static=3)


def partitioned_dense(*operands, local_op: Callable, reference: Callable, params: dict):
    """``local_op(*operands, **params)`` under the partitioning rules above."""
    params = Params.static(params)
    return _partitioned(local_op, reference, params, *operands)
