"""The GEMM primitive ``jax_tma_dot_general`` behind ``jax_tma.dot_general`` and
``jax_tma.matmul`` (jax_tma/ops/gemm/api.py), and its rules:

- JVP by bilinearity and transposes that bind the same primitive with other dimension numbers,
  so the backward pass of ``x @ w`` is two more kernels reading x, w and the cotangent in
  place (transposed operands are strides of the kernel, never copies);
- a batching rule that adds vmapped axes to the batch (both operands mapped) or to the free
  dimensions of the mapped operand, which the kernel folds into M or its batch axis;
- sharding through ``custom_partitioning`` (sharding.py), in the path on every platform.

It lowers to XLA's dot everywhere (with the product's precision), and on CUDA to the
``jax_tma_gemm_sm90`` FFI kernel when the operands can be read in place (plan.py) or after a
transpose (``kernel_route``), the sizes are within what the kernel takes (config.MAX_DIM,
MAX_WORK_UNITS, MAX_BUFFER_BYTES) and the kernel can run there. Every other product lowers to
XLA's dot: none is left to fail at run time.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, batching

from jax_tma import _ext
from jax_tma._core import device
from jax_tma._core.aval import result_aval
from jax_tma._core.primitive import define_primitive, kernel_ffi_call, sum_split_partials
from jax_tma.ops.gemm import plan as gemm_plan
from jax_tma.ops.gemm import sharding as gemm_sharding
from jax_tma.ops.gemm import tuned
from jax_tma.ops.gemm.config import (_EPILOGUE_DIRECT, _EPILOGUE_TMA_STORE, KERNEL_INPUT_DTYPES,
                                     MAX_BUFFER_BYTES, MAX_WORK_UNITS, GemmConfig, check_config,
                                     copy_seconds, estimate_seconds, kernel_output_dtypes,
                                     ranked_configs, tma_store_aligned, xla_reason)
from jax_tma.ops.gemm.plan import (DimensionNumbers, GemmPlan, free_axes, out_strides,
                                   output_shape)

KERNEL_TARGET = "jax_tma_gemm_sm90"
# Every FFI target a lowering of these ops can emit (the second writes over a given buffer:
# jax_tma._testing). Names are stable: serialized modules (jax.export) refer to them.
FFI_TARGETS = (KERNEL_TARGET, KERNEL_TARGET + "_into")


def _kernel_dtypes(lhs_dtype, rhs_dtype, out_dtype) -> bool:
    lhs_dtype, rhs_dtype = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
    return (lhs_dtype == rhs_dtype and lhs_dtype in KERNEL_INPUT_DTYPES
            and jnp.dtype(out_dtype) in kernel_output_dtypes(lhs_dtype))


_KERNEL_PRESETS = {
    lax.DotAlgorithmPreset.BF16_BF16_F32: jnp.dtype(jnp.bfloat16),
    lax.DotAlgorithmPreset.F16_F16_F32: jnp.dtype(jnp.float16),
}


def kernel_precision(precision, in_dtype) -> bool:
    """Whether `precision` (canonical, as ``lax.dot_general`` holds it) asks, for operands of
    in_dtype, for what the kernel computes: products of the 16-bit operands as they are,
    accumulated in fp32.

    That is None, any ``lax.Precision`` pair (16-bit products are exact in fp32 whatever the
    precision), ``DotAlgorithmPreset.DEFAULT``, ``BF16_BF16_F32`` on bf16 operands,
    ``F16_F16_F32`` on fp16 ones, and the ``DotAlgorithm`` that spells one of those two out.
    Every other algorithm rounds the operands to another type (F16_F16_F32 on bf16), accumulates
    in another (BF16_BF16_BF16, F16_F16_F16) or splits them (the _X3 ones): those products go to
    ``lax.dot_general``, which computes them, or raises where the platform has no such
    algorithm.
    """
    in_dtype = jnp.dtype(in_dtype)
    if precision is None or precision == lax.DotAlgorithmPreset.DEFAULT:
        return True
    if isinstance(precision, lax.DotAlgorithm):
        return (jnp.dtype(precision.lhs_precision_type) == in_dtype
                and jnp.dtype(precision.rhs_precision_type) == in_dtype
                and jnp.dtype(precision.accumulation_type) == jnp.float32
                and (precision.lhs_component_count, precision.rhs_component_count,
                     precision.num_primitive_operations) == (1, 1, 1)
                and not precision.allow_imprecise_accumulation)
    if isinstance(precision, lax.DotAlgorithmPreset):
        return _KERNEL_PRESETS.get(precision) == in_dtype
    return (isinstance(precision, tuple) and len(precision) == 2
            and all(isinstance(p, lax.Precision) for p in precision))


def _is_algorithm(precision) -> bool:
    return isinstance(precision, (lax.DotAlgorithm, lax.DotAlgorithmPreset))


_FP8_KINDS = ("float8",)


def _kernel_input_dtype(lhs_dtype, rhs_dtype, out_dtype, precision):
    """The 16-bit type the kernel would read for ``lax.dot_general`` of these operand types
    into out_dtype with `precision` (canonical), or None when the kernel does not compute it.

    Operands of one type are read as they are. Operands of two types are what lax converts, on
    CUDA (and CPU), to the output type before an XLA dot when no algorithm is named (bf16 x
    weak fp32 from ``jnp.matmul``, bf16 x fp16 into bf16): the kernel reads them converted
    alike."""
    lhs_dtype, rhs_dtype = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
    out_dtype = jnp.dtype(out_dtype)
    if lhs_dtype == rhs_dtype:
        in_dtype = lhs_dtype
    elif (_is_algorithm(precision) or out_dtype not in KERNEL_INPUT_DTYPES
          or all(d.name.startswith(_FP8_KINDS) for d in (lhs_dtype, rhs_dtype))):
        return None  # lax keeps the types (algorithms, pairs of fp8 types) or computes wider
    else:
        in_dtype = out_dtype
    if (not _kernel_dtypes(in_dtype, in_dtype, out_dtype)
            or not kernel_precision(precision, in_dtype)):
        return None
    return in_dtype


@dataclasses.dataclass(frozen=True)
class KernelRoute:
    """How the kernel computes a product: transpose the operands by `lhs_perm` / `rhs_perm`
    (None: as they are), reshape them to `lhs_shape` / `rhs_shape` (None: keep the shape; a
    reshape of adjacent axes moves no data), then read them as `plan` says. The kernel's
    dense [batch, M, N] output is the product's output, whatever the route."""

    plan: GemmPlan
    lhs_perm: tuple[int, ...] | None = None
    rhs_perm: tuple[int, ...] | None = None
    lhs_shape: tuple[int, ...] | None = None
    rhs_shape: tuple[int, ...] | None = None

    @property
    def copies(self) -> bool:
        """Whether an operand is transposed (a copy) before the kernel."""
        return self.lhs_perm is not None or self.rhs_perm is not None

    def operand_copies(self, lhs_shape, rhs_shape) -> tuple[int, int]:
        """(copies, elements copied) before the kernel, for operands of these shapes: one per
        transpose and one per pad of rows that are not 16-byte multiples, each of a whole
        operand."""
        copies, elements = 0, 0
        for shape, perm, view in ((lhs_shape, self.lhs_perm, self.plan.lhs),
                                  (rhs_shape, self.rhs_perm, self.plan.rhs)):
            count = (perm is not None) + bool(view.pad)
            copies += count
            elements += count * math.prod(shape)
        return copies, elements


def _permuted(perm, dims_of_operand):
    """Axes of an operand after ``lax.transpose(x, perm)``."""
    return tuple(perm.index(a) for a in dims_of_operand)


def _route_candidates(lhs_shape, rhs_shape, dimension_numbers):
    """(lhs perm, rhs perm, lhs reshape, rhs reshape, dimension numbers after them) of each
    way to lay the operands out for the kernel, from fewest copies to most: in place; one
    operand transposed into [batch, free, contracting] (lhs) or [batch, contracting, free]
    (rhs) order, contracting dims in the other's order; both; both, each group of dims merged
    into one axis (rows that span several axes can then be padded)."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf, rf = free_axes(len(lhs_shape), lc, lb), free_axes(len(rhs_shape), rc, rb)
    lhs_by_rhs = tuple(l for _, l in sorted(zip(rc, lc)))  # contracting pairs in rhs's order
    rhs_by_lhs = tuple(r for _, r in sorted(zip(lc, rc)))
    lhs_canonical, rhs_canonical = (*lb, *lf, *lhs_by_rhs), (*rb, *rhs_by_lhs, *rf)
    both_lhs, both_rhs = (*lb, *lf, *lc), (*rb, *rc, *rf)
    yield None, None, None, None, dimension_numbers
    for lhs_perm, rhs_perm in ((None, rhs_canonical), (lhs_canonical, None), (both_lhs, both_rhs)):
        lp = lhs_perm or tuple(range(len(lhs_shape)))
        rp = rhs_perm or tuple(range(len(rhs_shape)))
        dims = ((_permuted(lp, lc), _permuted(rp, rc)), (_permuted(lp, lb), _permuted(rp, rb)))
        yield lhs_perm, rhs_perm, None, None, dims
    size = lambda shape, axes: math.prod(shape[a] for a in axes)  # noqa: E731
    batch, k = size(lhs_shape, lb), size(lhs_shape, lc)
    yield (both_lhs, both_rhs, (batch, size(lhs_shape, lf), k), (batch, k, size(rhs_shape, rf)),
           (((2,), (1,)), ((0,), (0,))))


def kernel_route(lhs_aval, rhs_aval, dimension_numbers: DimensionNumbers, out_dtype,
                 precision=None) -> KernelRoute | None:
    """The cheapest way for the kernel to compute this product, or None when it runs through
    XLA (types or a precision the kernel does not compute, an empty product, sizes past the
    kernel's limits, a batch that is an operand's only dimension of more than one element).

    Operands are read in place where gemm_plan finds a view of them. Otherwise the layout that
    copies the fewest elements (transposes, and the pads of rows that are not 16-byte
    multiples) among _route_candidates: e.g. the smaller operand transposed for two
    contracting dims in opposite orders ([M, K1, K2] . [K2, K1, N]) or a batch axis innermost;
    merged dims for free dims over several axes whose rows are not 16-byte multiples."""
    if not _kernel_dtypes(lhs_aval.dtype, rhs_aval.dtype, out_dtype):
        return None
    if not kernel_precision(precision, lhs_aval.dtype):
        return None
    lhs_shape, rhs_shape = tuple(lhs_aval.shape), tuple(rhs_aval.shape)
    if min(math.prod(lhs_shape), math.prod(rhs_shape)) == 0:
        return None
    best = None
    for lhs_perm, rhs_perm, lhs_reshape, rhs_reshape, dims in _route_candidates(
            lhs_shape, rhs_shape, dimension_numbers):
        identity = lambda perm: perm is not None and list(perm) == sorted(perm)  # noqa: E731
        lhs_perm = None if identity(lhs_perm) else lhs_perm
        rhs_perm = None if identity(rhs_perm) else rhs_perm
        lhs_now = lhs_reshape or tuple(lhs_shape[a] for a in (lhs_perm or range(len(lhs_shape))))
        rhs_now = rhs_reshape or tuple(rhs_shape[a] for a in (rhs_perm or range(len(rhs_shape))))
        found = gemm_plan.plan(lhs_now, rhs_now, dims)
        if found is None:
            continue
        route = KernelRoute(found, lhs_perm, rhs_perm, lhs_reshape, rhs_reshape)
        copied = route.operand_copies(lhs_shape, rhs_shape)[1]
        if best is None or copied < best[0]:
            best = (copied, route)
        if lhs_perm is None and rhs_perm is None:
            break  # in place: nothing copies less (a pad it needs, any other layout needs too)
    return None if best is None else best[1]


def kernel_plan(lhs_aval, rhs_aval, dimension_numbers: DimensionNumbers,
                out_dtype) -> GemmPlan | None:
    """The kernel's view of this product read in place, or None (dtypes the kernel does not
    take, an empty product, operands that cannot be read in place, sizes past its limits)."""
    if not _kernel_dtypes(lhs_aval.dtype, rhs_aval.dtype, out_dtype):
        return None
    return gemm_plan.plan(lhs_aval.shape, rhs_aval.shape, dimension_numbers)


def config_for(plan: GemmPlan, out_dtype, config: GemmConfig | None, *, in_dtype=None,
               use_cache: bool = True) -> GemmConfig | None:
    """`config`, checked against the product (ValueError naming the shapes if it cannot
    compute it), or else the autotuning cache's entry for the product (jax_tma.autotune; read
    where `in_dtype` is given and `use_cache`), or else the heuristic's choice: None when no
    configuration can (the product runs on XLA)."""
    out_dtype = jnp.dtype(out_dtype)
    if config is None and use_cache and in_dtype is not None:
        found = tuned.lookup(plan, in_dtype, out_dtype)
        if found is not None:
            return found
    if config is None:
        ranked = ranked_for(plan, out_dtype)
        return ranked[0] if ranked else None
    check_config(config, plan.m, plan.n, plan.k, out_dtype, out_strides(plan), plan.batch)
    return config


def ranked_for(plan: GemmPlan, out_dtype) -> list[GemmConfig]:
    """Every configuration the heuristic scores for the product, best first on this device
    (config.ranked_configs, whose first is default_config's choice: config_for's without a
    cache entry)."""
    return ranked_configs(plan.m, plan.n, plan.k, device.num_sms(), jnp.dtype(out_dtype),
                          batch=plan.batch, out_strides=out_strides(plan),
                          misaligned_rows=plan.misaligned_rows,
                          dram_bytes_per_s=device.dram_bytes_per_s(), l2_bytes=device.l2_bytes())


_READ_CACHE = object()  # why_xla's `measured` default: read the autotuning cache


def why_xla(route: KernelRoute, cfg: GemmConfig, lhs_aval, rhs_aval, out_dtype,
            measured=_READ_CACHE) -> str | None:
    """Why XLA's dot is faster than the kernel (configuration `cfg`, reached by `route`) on this
    product, or None. Measured where jax_tma.autotune timed both on this device (the cache's
    verdict, either way; `measured`: the (kernel, XLA) seconds the caller already read from the
    cache, or None where it has none); otherwise config.xla_reason on the plan's sizes, the
    copies the route makes (transposes, pads of rows that are not 16-byte multiples) and the
    kernel's estimate."""
    plan = route.plan
    if measured is _READ_CACHE:
        measured = tuned.measured_against_xla(plan, lhs_aval.dtype, out_dtype)
    if measured is not None:
        kernel_s, xla_s = measured
        return (f"jax_tma.autotune measured XLA's dot at {xla_s * 1e6:.1f} us against "
                f"{kernel_s * 1e6:.1f} us for the kernel's best configuration"
                if xla_s < kernel_s else None)
    copies, elements = route.operand_copies(lhs_aval.shape, rhs_aval.shape)
    bandwidth = device.dram_bytes_per_s()
    kernel_s = estimate_seconds(cfg, plan.m, plan.n, plan.k, device.num_sms(),
                                jnp.dtype(out_dtype).itemsize, plan.batch, plan.misaligned_rows,
                                bandwidth, device.l2_bytes())
    copy_s = copy_seconds(copies, elements * jnp.dtype(lhs_aval.dtype).itemsize, bandwidth)
    return xla_reason(plan.m, plan.n, plan.k, kernel_s, copy_s, plan.batch)


def kernel_choice(lhs_aval, rhs_aval, dimension_numbers: DimensionNumbers, out_dtype,
                  precision=None, config: GemmConfig | None = None,
                  xla_when_faster: bool | None = None) -> tuple[KernelRoute, GemmConfig] | None:
    """(route, configuration) with which the lowering runs the kernel on this product, or None
    where it runs XLA's dot: no route (kernel_route), no configuration (config_for), or, when
    the caller names no `config` and `xla_when_faster` (default: unless JAX_TMA_KERNEL_ALWAYS
    is set), a product XLA computes faster (why_xla). A `config` that cannot compute the
    product is a ValueError naming the shapes."""
    route = kernel_route(lhs_aval, rhs_aval, dimension_numbers, out_dtype, precision)
    if route is None:
        return None
    # One read of the autotuning cache gives both the configuration and XLA's time against it.
    cached = (tuned.cached(route.plan, lhs_aval.dtype, out_dtype) if config is None
              else None)
    cfg = cached[0] if cached else config_for(route.plan, out_dtype, config, use_cache=False)
    if cfg is None:
        return None
    if xla_when_faster is None:
        xla_when_faster = not _ext.kernel_always()
    if config is None and xla_when_faster and why_xla(route, cfg, lhs_aval, rhs_aval, out_dtype,
                                                      cached[1] if cached else None):
        return None
    return route, cfg


# --------------------------------------------------------------------------------------
# The primitive.

def _abstract_eval(lhs, rhs, *, dimension_numbers, out_dtype, precision, config, local):
    del precision, config, local
    return result_aval(output_shape(lhs.shape, rhs.shape, dimension_numbers), out_dtype, lhs,
                       rhs)


def _reference(lhs, rhs, *, dimension_numbers, out_dtype, precision, config, local):
    del config, local
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=out_dtype)


def _pad(x: jax.Array, view: gemm_plan.OperandView) -> jax.Array:
    if not view.pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[view.pad_axis] = (0, view.pad)
    return jnp.pad(x, widths)


def _kernel_call(lhs, rhs, *, plan: GemmPlan, dimension_numbers, out_dtype, config,
                 poison=False, route: KernelRoute | None = None):
    """The FFI call for `plan`: lays the operands out as `route` says (transposes, reshapes),
    pads rows that are not 16-byte multiples, runs the kernel and sums split-K partial
    products. `config` None: the heuristic's. With `poison`, the kernel writes over NaN-filled
    buffers (tests)."""
    out_dtype = jnp.dtype(out_dtype)
    out_shape = output_shape(lhs.shape, rhs.shape, dimension_numbers)
    if route is not None:
        if route.lhs_perm is not None:
            lhs = lax.transpose(lhs, route.lhs_perm)
        if route.rhs_perm is not None:
            rhs = lax.transpose(rhs, route.rhs_perm)
        if route.lhs_shape is not None:
            lhs = lhs.reshape(route.lhs_shape)
        if route.rhs_shape is not None:
            rhs = rhs.reshape(route.rhs_shape)
    lhs, rhs = _pad(lhs, plan.lhs), _pad(rhs, plan.rhs)
    cfg = config_for(plan, out_dtype, config)
    if cfg is None:
        raise ValueError(
            f"jax_tma: no kernel configuration computes {plan.batch} x ({plan.m}, {plan.n}) "
            f"outputs with K={plan.k} (more than {MAX_WORK_UNITS} work units, or "
            f"{MAX_BUFFER_BYTES} output bytes)"
        )
    splits = cfg.splits_for(plan.k)
    d_dtype = jnp.dtype(jnp.float32) if splits > 1 else out_dtype
    out_size = math.prod(out_shape)
    d_shape = (splits, *out_shape) if splits > 1 else out_shape
    aligned = tma_store_aligned(out_strides(plan), d_dtype)
    i64 = np.int64
    attrs = dict(
        block_m=i64(cfg.block_m), block_n=i64(cfg.block_n), stages=i64(cfg.stages),
        cluster_m=i64(cfg.cluster_m),
        epilogue=i64(_EPILOGUE_TMA_STORE if aligned else _EPILOGUE_DIRECT),
        splits=i64(splits), stream_k=i64(cfg.stream_k),
        m=i64(plan.m), n=i64(plan.n), k=i64(plan.k), batch=i64(plan.batch),
        a_batch_stride=i64(plan.lhs.batch_stride), a_m_stride=i64(plan.lhs.outer_stride),
        a_k_stride=i64(plan.lhs.k_stride),
        b_batch_stride=i64(plan.rhs.batch_stride), b_k_stride=i64(plan.rhs.k_stride),
        b_n_stride=i64(plan.rhs.outer_stride),
        d_split_stride=i64(out_size), d_batch_stride=i64(plan.d_batch_stride),
        d_m_stride=i64(plan.d_m_stride),
    )
    out_types = (jax.ShapeDtypeStruct(d_shape, d_dtype),
                 jax.ShapeDtypeStruct((cfg.stream_k_workspace_bytes(device.num_sms()),), jnp.uint8))
    d, _ = kernel_ffi_call(KERNEL_TARGET, out_types, (lhs, rhs), attrs, poison=poison)
    if splits > 1:
        d = sum_split_partials(d).astype(out_dtype)
    return d


@functools.cache
def _local_dot(precision):
    """One device's product with `precision`, in the form gemm_sharding calls (one function
    per precision: it is a static argument of the partitioned call)."""

    def local_dot(lhs, rhs, dimension_numbers, out_dtype, config):
        return dot_general_p.bind(lhs, rhs, dimension_numbers=dimension_numbers,
                                  out_dtype=out_dtype, precision=precision, config=config,
                                  local=True)

    return local_dot


def _bind(lhs, rhs, dimension_numbers, out_dtype, precision, local=False):
    # Products derived by the rules (gradients, vmapped products) have their own shapes:
    # the heuristic picks their configuration.
    return dot_general_p.bind(lhs, rhs, dimension_numbers=dimension_numbers,
                              out_dtype=jnp.dtype(out_dtype), precision=precision, config=None,
                              local=local)


# ---------------------------------------------------------------- autodiff


def _ranks(x) -> int:
    return len(x.aval.shape) if hasattr(x, "aval") else np.ndim(x)


def _transpose_to(result: jax.Array, axes: list[int]) -> jax.Array:
    """Result whose dimension i holds axis axes[i] of the target, put in target order."""
    perm = tuple(int(i) for i in np.argsort(axes))
    return result if perm == tuple(range(len(perm))) else lax.transpose(result, perm)


def _transpose_lhs(g, x, y, *, dimension_numbers, out_dtype, precision, config, local):
    """Cotangent of lhs: g contracted with rhs over rhs's free dims, batch dims kept (with
    the product's precision, as lax's rule)."""
    del out_dtype, config
    (xc, yc), (xb, yb) = dimension_numbers
    x_ndim, y_ndim = len(x.aval.shape), _ranks(y)
    x_free, y_free = free_axes(x_ndim, xc, xb), free_axes(y_ndim, yc, yb)
    nb = len(xb)
    g_y_free = tuple(range(nb + len(x_free), nb + len(x_free) + len(y_free)))
    dims = ((g_y_free, tuple(y_free)), (tuple(range(nb)), tuple(yb)))
    result = _bind(g, y, dims, x.aval.dtype, precision, local)
    # result: [batch, x's free dims, y's contracting dims in y's axis order]
    axes = [*xb, *x_free, *(xc[yc.index(a)] for a in sorted(yc))]
    return _transpose_to(result, axes)


def _transpose_rhs(g, x, y, *, dimension_numbers, out_dtype, precision, config, local):
    """Cotangent of rhs: lhs contracted with g over lhs's free dims, batch dims kept."""
    del out_dtype, config
    (xc, yc), (xb, yb) = dimension_numbers
    x_ndim, y_ndim = _ranks(x), len(y.aval.shape)
    x_free, y_free = free_axes(x_ndim, xc, xb), free_axes(y_ndim, yc, yb)
    nb = len(xb)
    g_x_free = tuple(range(nb, nb + len(x_free)))
    dims = ((tuple(x_free), g_x_free), (tuple(xb), tuple(range(nb))))
    result = _bind(x, g, dims, y.aval.dtype, precision, local)
    # result: [batch, x's contracting dims in x's axis order, y's free dims]
    axes = [*yb, *(yc[xc.index(a)] for a in sorted(xc)), *y_free]
    return _transpose_to(result, axes)


# ---------------------------------------------------------------- batching


def _shift(axes, inserted):
    return tuple(a + (a >= inserted) for a in axes)


def _broadcast_instead(mapped, other, axis: int, other_is_lhs: bool, dims, out_dtype,
                       precision) -> DimensionNumbers | None:
    """Dimension numbers for `other` broadcast along a new leading axis of the size of
    `mapped`'s axis `axis` (so both are mapped and it joins the batch dims), when the kernel
    cannot read `mapped` in place with that axis among its free dims but can read the pair
    this way, and broadcasting copies fewer elements than the transpose of `mapped` and the
    move of vmap's result that the other way costs; else None.

    dims: the dimension numbers with the mapped axis free (the default)."""
    lhs, rhs = (other, mapped) if other_is_lhs else (mapped, other)
    if _kernel_input_dtype(lhs.dtype, rhs.dtype, out_dtype, precision) is None:
        return None
    if gemm_plan.plan(lhs.shape, rhs.shape, dims) is not None:
        return None
    (lc, rc), (lb, rb) = dims
    size = mapped.shape[axis]
    if other_is_lhs:
        new = ((_shift(lc, 0), rc), ((0, *_shift(lb, 0)), (axis, *rb)))
        shapes = ((size, *lhs.shape), rhs.shape)
    else:
        new = ((lc, _shift(rc, 0)), ((axis, *lb), (0, *_shift(rb, 0))))
        shapes = (lhs.shape, (size, *rhs.shape))
    if gemm_plan.plan(*shapes, new) is None:
        return None
    out_size = math.prod(output_shape(lhs.shape, rhs.shape, dims))
    if size * math.prod(other.shape) > math.prod(mapped.shape) + out_size:
        return None
    return new


def _batch_rule(args, dims, *, dimension_numbers, out_dtype, precision, config, local):
    """vmap: a mapped axis of both operands joins the batch dims; a mapped axis of one
    operand becomes one of its free dims (the kernel folds it into M or a batch axis), or,
    where the kernel could not then read that operand in place (vmap(vmap(f), (0, None))
    maps an operand that has batch dims already), the other operand is broadcast along it
    when that copies less than transposing the mapped operand would."""
    del config
    lhs, rhs = args
    ld, rd = dims
    (lc, rc), (lb, rb) = dimension_numbers

    if ld is not None and rd is not None:
        new = ((_shift(lc, ld), _shift(rc, rd)), ((ld, *_shift(lb, ld)), (rd, *_shift(rb, rd))))
        return _bind(lhs, rhs, new, out_dtype, precision, local), 0
    if ld is not None:
        lc, lb = _shift(lc, ld), _shift(lb, ld)
        new = _broadcast_instead(lhs, rhs, ld, False, ((lc, rc), (lb, rb)), out_dtype, precision)
        if new is not None:
            rhs = jnp.broadcast_to(rhs, (lhs.shape[ld], *rhs.shape))
            return _bind(lhs, rhs, new, out_dtype, precision, local), 0
        free = free_axes(lhs.ndim, lc, lb)
        out_dim = len(lb) + free.index(ld)
        return _bind(lhs, rhs, ((lc, rc), (lb, rb)), out_dtype, precision, local), out_dim
    rc, rb = _shift(rc, rd), _shift(rb, rd)
    new = _broadcast_instead(rhs, lhs, rd, True, ((lc, rc), (lb, rb)), out_dtype, precision)
    if new is not None:
        lhs = jnp.broadcast_to(lhs, (rhs.shape[rd], *lhs.shape))
        return _bind(lhs, rhs, new, out_dtype, precision, local), 0
    free = free_axes(rhs.ndim, rc, rb)
    lhs_free = lhs.ndim - len(lc) - len(lb)
    out_dim = len(lb) + lhs_free + free.index(rd)
    return _bind(lhs, rhs, ((lc, rc), (lb, rb)), out_dtype, precision, local), out_dim


def _kernel_fn(avals_in, params):
    """The kernel call of one device's product, or None where XLA's dot runs it."""
    choice = kernel_choice(*avals_in, params["dimension_numbers"], params["out_dtype"],
                           params["precision"], params["config"])
    if choice is None:
        return None
    route, cfg = choice
    return functools.partial(_kernel_call, plan=route.plan,
                             dimension_numbers=params["dimension_numbers"],
                             out_dtype=params["out_dtype"], config=cfg, route=route)


def _partitioned(params):
    return functools.partial(
        gemm_sharding.partitioned_dot, local_dot=_local_dot(params["precision"]),
        dimension_numbers=params["dimension_numbers"], out_dtype=params["out_dtype"],
        config=params["config"])


dot_general_p = define_primitive("jax_tma_dot_general", abstract_eval=_abstract_eval,
                                 reference=_reference, kernel_fn=_kernel_fn,
                                 partitioned=_partitioned)
ad.defbilinear(dot_general_p, _transpose_lhs, _transpose_rhs)
batching.primitive_batchers[dot_general_p] = _batch_rule
