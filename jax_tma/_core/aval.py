"""Abstract values of the primitives' results.

Inside ``jax.shard_map`` (with its default ``check_vma=True``) every value carries the mesh axes
along which it varies; a primitive's result varies along the axes its operands vary along, and
autodiff checks that each cotangent varies like its primal. A result built as a bare
``ShapedArray`` varies along none, and the transpose of a product inside shard_map then fails
("Expected cotangent type ...{V:axis} but got ..."). ``result_aval`` copies the operands'
manual-axis type onto the result. jax has named that attribute differently across releases
(``vma``; ``manual_axis_type`` with ``.varying``), so both are read, and where neither exists
the result is the bare ``ShapedArray`` (no shard_map types to carry).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core


def _varying(aval: Any) -> frozenset:
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", frozenset()))
    return frozenset(getattr(aval, "vma", frozenset()))


def result_aval(shape, dtype, *operands: Any) -> jax.core.ShapedArray:
    """A ``ShapedArray(shape, dtype)`` varying along every mesh axis an operand varies along
    (the manual-axis type of the operand that varies along the most; operands of a product
    inside shard_map vary alike)."""
    out = jax.core.ShapedArray(shape, dtype)
    varying = [(_varying(a), a) for a in operands]
    widest, template = max(varying, key=lambda v: len(v[0]), default=(frozenset(), None))
    if not widest:
        return out
    mat = getattr(template, "manual_axis_type", None)
    if mat is not None and hasattr(out, "update_manual_axis_type"):
        # The manual axes belong to the operand's mesh: the result is on it too, replicated.
        mesh = template.sharding.mesh
        out = jax.core.ShapedArray(shape, dtype, sharding=jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec()))
        return out.update_manual_axis_type(mat)
    return out.update(vma=widest)


def _pcast_varying(x, axes: tuple):
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        return pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # jax releases before pcast


def match_varying(args) -> list:
    """The operands, each cast (a no-op on the data) to vary along every mesh axis any of them
    varies along, as jax's own primitives do before they bind: a replicated weight times
    sharded rows inside shard_map. The cast's transpose sums the weight's cotangent over the
    axes, so its gradient is the full one."""
    varying = [_varying(jax.typeof(a)) for a in args]
    union = frozenset().union(*varying)
    if not union:
        return list(args)
    return [a if v == union else _pcast_varying(a, tuple(sorted(union - v)))
            for a, v in zip(args, varying)]


class Primitive(jax.extend.core.Primitive):
    """A primitive whose operands are made to vary alike before it binds (match_varying)."""

    def bind(self, *args, **params):
        return super().bind(*match_varying(args), **params)


def sum_to_varying(ct, primal):
    """A cotangent summed over the mesh axes it varies along and its primal does not (the
    primal was replicated there): what a custom_vjp's backward rule must return inside
    shard_map, where the rule's products vary along every axis of their operands."""
    extra = _varying(jax.typeof(ct)) - _varying(jax.typeof(primal))
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct
