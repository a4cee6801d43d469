"""How a ``dot_general`` maps onto the strided, batched sm90 GEMM kernel, without copies.

The kernel computes, for b in [0, batch), D[b] = A[b] @ B[b] where A, B and D are strided views
of dense row-major buffers (element strides):

    A[b, m, k] at b * a_batch + m * a_m + k * a_k      one of a_m, a_k is 1 (M- or K-major)
    B[b, k, n] at b * b_batch + k * b_k + n * b_n      one of b_k, b_n is 1 (K- or N-major)
    D[s, b, m, n] at s * d_split + b * d_batch + m * d_m + n

and a batch stride of 0 broadcasts that operand over the batch. ``plan`` finds such a view for
the operands of a ``dot_general`` as they lie in memory: each group of dimensions (batch,
free, contracting) must be a run of adjacent axes in order, so that it merges into one
strided index; the transposes a user or an autodiff rule asks for become strides. When the
free dimensions of one operand are not adjacent (``vmap`` over only one operand puts the
mapped axis in front of them), the outer one becomes a batch axis over which the other operand
is broadcast. Anything else returns None and runs through XLA, as do products larger than the
kernel takes (config.MAX_DIM, MAX_BUFFER_BYTES).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Sequence

from jax_tma.ops.gemm.config import MAX_BUFFER_BYTES, MAX_DIM, PAD_ELEMS, STRIDE_ELEMS

_IN_BYTES = 2  # the kernel reads 16-bit operands

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]],
                         tuple[tuple[int, ...], tuple[int, ...]]]
MATMUL_DIMS: DimensionNumbers = (((1,), (0,)), ((), ()))  # a[M, K] @ b[K, N]


@dataclasses.dataclass(frozen=True)
class OperandView:
    """One operand as the kernel reads it. `pad` > 0: first pad axis `pad_axis` by that many
    elements (rows whose length is not a 16-byte multiple, padded to a 32-byte one); the
    strides count the pad."""

    batch_stride: int  # 0: broadcast over the batch
    outer_stride: int  # stride of the free index (M of A, N of B)
    k_stride: int
    pad: int = 0
    pad_axis: int = -1

    @property
    def k_major(self) -> bool:
        return self.k_stride == 1


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    m: int
    n: int
    k: int
    batch: int
    lhs: OperandView
    rhs: OperandView
    d_batch_stride: int
    d_m_stride: int

    @property
    def misaligned_rows(self) -> str:
        """The operands, "a" and/or "b", with more than one row whose rows are not 32-byte
        multiples apart (16-bit elements): TMA loads them slower (config.estimate_seconds)."""
        def misaligned(view: OperandView, free: int) -> bool:
            pitch, rows = (view.outer_stride, free) if view.k_major else (view.k_stride, self.k)
            return rows > 1 and (2 * pitch) % 32 != 0
        return "a" * misaligned(self.lhs, self.m) + "b" * misaligned(self.rhs, self.n)

    @property
    def layout(self) -> str:
        """NN, NT, TN or TT: whether A is stored transposed (M-major), then B (K-major)."""
        return ("N" if self.lhs.k_major else "T") + ("T" if self.rhs.k_major else "N")


def out_strides(plan: GemmPlan) -> tuple[int, ...]:
    """Strides of D (elements) that a TMA store steps by: rows, and batch entries where there
    is more than one. (Split-K partial products lie batch * M * N apart, a multiple of these.)"""
    strides = [plan.d_m_stride]
    if plan.batch > 1:
        strides.append(plan.d_batch_stride)
    return tuple(strides)


def free_axes(ndim: int, contract_axes, batch_axes) -> list[int]:
    """The axes of an operand of rank `ndim` that are neither contracted nor batch, in order:
    ``dot_general`` puts them in the output after the batch dims, lhs's before rhs's."""
    return [a for a in range(ndim) if a not in contract_axes and a not in batch_axes]


def _row_major_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [0] * len(shape), 1
    for i in reversed(range(len(shape))):
        strides[i] = step
        step *= shape[i]
    return strides


def _merge(shape: Sequence[int], strides: Sequence[int], axes: Sequence[int]) -> int | None:
    """Stride of the one row-major index that `axes` (in this order) form, 0 for an index that
    is always 0, or None when they do not form one. Size-1 axes never move the address and
    are dropped; the rest must be adjacent in memory and in order."""
    kept = [a for a in axes if shape[a] != 1]
    if not kept:
        return 0
    for outer, inner in zip(kept, kept[1:]):
        if strides[outer] != strides[inner] * shape[inner]:
            return None
    return strides[kept[-1]]


def _operand(shape: Sequence[int], batch_group, free_group, contract_group,
             broadcast: bool) -> OperandView | None:
    """How the kernel reads one operand whose (batch, free, contracting) axes are given."""
    nontrivial = [a for a in range(len(shape)) if shape[a] != 1]
    if not nontrivial:  # a single element: any layout reads it
        return OperandView(0, STRIDE_ELEMS, 1)
    inner = nontrivial[-1]
    if inner in batch_group:
        return None  # the unit stride must belong to K or to the free index
    k_inner = inner in contract_group
    owner = contract_group if k_inner else free_group

    def view(pad: int) -> OperandView | None:
        padded = list(shape)
        padded[inner] += pad
        strides = _row_major_strides(padded)
        groups = [_merge(shape, strides, g) for g in (batch_group, free_group, contract_group)]
        if any(g is None for g in groups):
            return None
        batch, free, contract = groups
        # An index that never moves gets any stride TMA accepts.
        free, contract = free or STRIDE_ELEMS, contract or STRIDE_ELEMS
        if k_inner:
            contract = 1
        else:
            free = 1
        batch = 0 if broadcast else batch
        if any(s > 1 and s % STRIDE_ELEMS for s in (batch, free, contract)):
            return None
        return OperandView(batch, free, contract, pad, inner if pad else -1)

    # Rows whose length is not a 16-byte multiple (TMA steps through global memory in 16-byte
    # units) are padded when the unit-stride index is that one axis, to a 32-byte multiple (TMA
    # loads rows an odd number of 16 bytes apart slower); strides count the pad.
    found = view(0)
    if found is None and [a for a in owner if shape[a] != 1] == [inner]:
        found = view(-shape[inner] % PAD_ELEMS)
    return found


def _within_limits(found: GemmPlan | None, lhs_shape, rhs_shape) -> GemmPlan | None:
    """`found`, or None where its sizes exceed what the kernel takes: m, n, k or batch past
    MAX_DIM, or an operand (padded) past MAX_BUFFER_BYTES. (The output's bytes depend on the
    configuration: config.check_config.)"""
    if found is None or max(found.m, found.n, found.k, found.batch) > MAX_DIM:
        return None
    for shape, view in ((lhs_shape, found.lhs), (rhs_shape, found.rhs)):
        elements = math.prod(shape)
        if view.pad:
            elements = elements // shape[view.pad_axis] * (shape[view.pad_axis] + view.pad)
        if elements * _IN_BYTES > MAX_BUFFER_BYTES:
            return None
    return found


def plan(lhs_shape: Sequence[int], rhs_shape: Sequence[int],
         dimension_numbers: DimensionNumbers) -> GemmPlan | None:
    """The kernel view of ``dot_general(lhs, rhs, dimension_numbers)`` on row-major operands,
    or None when the operands cannot be read in place or are larger than the kernel takes
    (the op then runs through XLA)."""
    lhs_shape, rhs_shape = tuple(lhs_shape), tuple(rhs_shape)
    return _within_limits(_plan(lhs_shape, rhs_shape, dimension_numbers), lhs_shape, rhs_shape)


def _plan(lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...],
          dimension_numbers: DimensionNumbers) -> GemmPlan | None:
    (lc, rc), (lb, rb) = dimension_numbers
    # Contracting (and batch) pairs index alike when both sides merge in the same order:
    # order the pairs by the lhs axis.
    lc, rc = zip(*sorted(zip(lc, rc))) if lc else ((), ())
    lf, rf = free_axes(len(lhs_shape), lc, lb), free_axes(len(rhs_shape), rc, rb)
    m = math.prod(lhs_shape[a] for a in lf)
    n = math.prod(rhs_shape[a] for a in rf)
    k = math.prod(lhs_shape[a] for a in lc)
    batch = math.prod(lhs_shape[a] for a in lb)
    if min(m, n, k, batch) < 1:
        return None

    def build(l_batch, l_free, r_batch, r_free, bcast_lhs, bcast_rhs, batch_size,
              d_batch, d_m):
        a = _operand(lhs_shape, l_batch, l_free, lc, bcast_lhs)
        b = _operand(rhs_shape, r_batch, r_free, rc, bcast_rhs)
        if a is None or b is None:
            return None
        mm = math.prod(lhs_shape[x] for x in l_free)
        nn = math.prod(rhs_shape[x] for x in r_free)
        return GemmPlan(mm, nn, k, batch_size, a, b, d_batch, d_m)

    # Output [batch..., lhs free..., rhs free...], row-major.
    direct = build(list(lb), lf, list(rb), rf, False, False, batch, m * n, n)
    if direct is not None or lb:
        return direct
    # No batch dimensions: an outer free axis that does not merge with the rest becomes a
    # batch axis, the other operand broadcast over it.
    if len(rf) > 1 and _merge(rhs_shape, _row_major_strides(rhs_shape), rf) is None:
        outer, rest = rf[0], rf[1:]
        n_rest = math.prod(rhs_shape[a] for a in rest)
        # D[b, m, n] of the output [lhs free, outer, rest]: batch stride n_rest, row stride n.
        return build([], lf, [outer], rest, True, False, rhs_shape[outer], n_rest, n)
    if len(lf) > 1 and _merge(lhs_shape, _row_major_strides(lhs_shape), lf) is None:
        outer, rest = lf[0], lf[1:]
        m_rest = math.prod(lhs_shape[a] for a in rest)
        return build([outer], rest, [], rf, False, True, lhs_shape[outer], m_rest * n, n)
    return None


def output_shape(lhs_shape, rhs_shape, dimension_numbers: DimensionNumbers) -> tuple[int, ...]:
    """Shape of ``dot_general``: batch dims, then lhs free dims, then rhs free dims."""
    (lc, rc), (lb, rb) = dimension_numbers
    return (*(lhs_shape[i] for i in lb),
            *(lhs_shape[i] for i in free_axes(len(lhs_shape), lc, lb)),
            *(rhs_shape[i] for i in free_axes(len(rhs_shape), rc, rb)))


def _index_tuple(x) -> tuple[int, ...]:
    """An axis or a sequence of axes as a tuple (lax.dot_general takes both)."""
    try:
        return (operator.index(x),)
    except TypeError:
        return tuple(operator.index(a) for a in x)


def normalize(dimension_numbers, lhs_ndim: int, rhs_ndim: int) -> DimensionNumbers:
    """lax.dot_general's dimension numbers (already validated by lax) as tuples of axes:
    None (un-batched matrix/vector products) and bare ints as lax reads them."""
    if dimension_numbers is None:
        dimension_numbers = (((lhs_ndim - 1,), (0,)), ((), ()))
    (lc, rc), (lb, rb) = dimension_numbers

    def axes(seq, ndim):
        return tuple(a % ndim for a in _index_tuple(seq))

    return ((axes(lc, lhs_ndim), axes(rc, rhs_ndim)), (axes(lb, lhs_ndim), axes(rb, rhs_ndim)))
