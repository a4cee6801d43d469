"""Pieces every op's ``custom_partitioning`` rules share: mesh axes of an operand's dimensions
(``spec_of``), the hand-out of mesh axes to one product's dimensions (``AxisClaims``), a
PartitionSpec entry from axes (``one``), the primitive's parameters as one hashable static
argument (``Params``), and the partitioned call itself (``partitioned_call``)."""

from __future__ import annotations

import functools
import math
from typing import Callable

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding

Axes = tuple[str, ...]


def axes_of(entry) -> Axes:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_of(sharding, ndim: int) -> list[Axes]:
    """Mesh axes of each dimension (replicated where the sharding is not a NamedSharding)."""
    if not isinstance(sharding, NamedSharding):
        return [()] * ndim
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    return [axes_of(e) for e in spec]


def one(axes: Axes):
    """A PartitionSpec entry for `axes`: None, one name, or the tuple."""
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


class AxisClaims:
    """Hands out a mesh's axes to one product's dimensions, each axis at most once, in the
    order the dimensions are claimed."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.used: set[str] = set()

    def __call__(self, candidates: Axes, size: int, unit: int = 1) -> Axes:
        """The axes of `candidates` not claimed yet, now claimed, if their devices divide a
        dimension of `size` into whole multiples of `unit`; else none (the dimension stays
        whole)."""
        axes = tuple(a for a in candidates if a not in self.used)
        if not axes or size % (math.prod(self.mesh.shape[a] for a in axes) * unit):
            return ()
        self.used.update(axes)
        return axes


class Params(dict):
    """A primitive's parameters as one hashable static argument."""

    def __hash__(self):
        return hash(tuple(sorted((k, repr(v)) for k, v in self.items())))

    @classmethod
    def static(cls, params: dict) -> "Params":
        """A primitive's parameters but ``local``, which the partitioned body's bind sets."""
        return cls({k: v for k, v in params.items() if k != "local"})


def partitioned_call(*, partition: Callable, infer_sharding_from_operands: Callable,
                     sharding_rule: Callable, num_static: int) -> Callable:
    """``call(local_op, *more_static, params, *operands)`` = ``local_op(*operands, **params)``
    under ``custom_partitioning`` with these rules; the first `num_static` arguments (local_op
    first, params last) are static and reach every rule ahead of its own arguments."""

    @functools.partial(custom_partitioning, static_argnums=tuple(range(num_static)))
    def call(*args):
        local_op, params = args[0], args[num_static - 1]
        return local_op(*args[num_static:], **params)

    call.def_partition(partition=partition,
                       infer_sharding_from_operands=infer_sharding_from_operands,
                       sharding_rule=sharding_rule)
    return call
