"""GEMM on Hopper: ``jax_tma.dot_general``, ``jax_tma.matmul`` and the primitive behind them.

``dot_general(lhs, rhs, dimension_numbers, ...)`` has the results, dtypes and errors of
``lax.dot_general``. Operands of one 16-bit float type (bf16 or fp16) with an output of that
type or fp32 bind the ``jax_tma_dot_general`` primitive; everything else goes straight to
``lax.dot_general``. The primitive carries its own rules:

- JVP by bilinearity and transposes that bind the same primitive with other dimension numbers,
  so the backward pass of ``x @ w`` is two more kernels reading x, w and the cotangent in
  place (transposed operands are strides of the kernel, never copies);
- a batching rule that adds vmapped axes to the batch (both operands mapped) or to the free
  dimensions of the mapped operand, which the kernel folds into M or its batch axis;
- sharding through ``custom_partitioning`` (jax_tma/gemm_sharding.py), in the path on every
  platform.

It lowers to XLA's dot everywhere, and on CUDA to the ``jax_tma_gemm_sm90`` FFI kernel when the
operands can be read in place (jax_tma/gemm_plan.py) and the kernel can run there.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax._src import dispatch
from jax.interpreters import ad, batching, mlir

from jax_tma import _ext, gemm_plan, gemm_sharding
from jax_tma.gemm_config import (  # noqa: F401 - re-exported: the gemm module's public names
    BLOCK_K,
    COMPILED_CONFIGS,
    DEFAULT_DRAM_BYTES_PER_S,
    DEFAULT_L2_BYTES,
    DEFAULT_NUM_SMS,
    KERNEL_INPUT_DTYPES,
    MAX_SPLIT_K,
    STRIDE_ELEMS,
    GemmConfig,
    check_config,
    default_config,
    estimate_seconds,
    kernel_output_dtypes,
    legal_configs,
    stream_k_shared_operand_bytes,
    tma_store_aligned,
)
from jax_tma.gemm_config import _EPILOGUE_DIRECT, _EPILOGUE_TMA_STORE
from jax_tma.gemm_plan import DimensionNumbers, GemmPlan, free_axes

KERNEL_TARGET = "jax_tma_gemm_sm90"
MATMUL_DIMS: DimensionNumbers = (((1,), (0,)), ((), ()))  # a[M, K] @ b[K, N]


def _num_sms() -> int:
    devices = _ext.cuda_devices()
    return int(getattr(devices[0], "core_count", DEFAULT_NUM_SMS)) if devices else DEFAULT_NUM_SMS


def _device_fact(query, default):
    """`query` (an _ext device query) of the device the kernels run on, or `default` where
    there is none or the driver does not say."""
    devices = _ext.cuda_devices()
    found = query(devices[0]) if devices else None
    return found or default


def _dram_bytes_per_s() -> float:
    """Peak DRAM bandwidth of the device the kernels run on (the heuristic's memory model)."""
    return _device_fact(_ext.peak_dram_bytes_per_s, DEFAULT_DRAM_BYTES_PER_S)


def _l2_bytes() -> int:
    """L2 cache of the device the kernels run on (the heuristic's model of stream-K)."""
    return _device_fact(_ext.l2_cache_bytes, DEFAULT_L2_BYTES)


def output_shape(lhs_shape, rhs_shape, dimension_numbers: DimensionNumbers) -> tuple[int, ...]:
    """Shape of ``dot_general``: batch dims, then lhs free dims, then rhs free dims."""
    (lc, rc), (lb, rb) = dimension_numbers
    return (*(lhs_shape[i] for i in lb),
            *(lhs_shape[i] for i in free_axes(len(lhs_shape), lc, lb)),
            *(rhs_shape[i] for i in free_axes(len(rhs_shape), rc, rb)))


def _kernel_dtypes(lhs_dtype, rhs_dtype, out_dtype) -> bool:
    lhs_dtype, rhs_dtype = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
    return (lhs_dtype == rhs_dtype and lhs_dtype in KERNEL_INPUT_DTYPES
            and jnp.dtype(out_dtype) in kernel_output_dtypes(lhs_dtype))


def kernel_plan(lhs_aval, rhs_aval, dimension_numbers: DimensionNumbers, out_dtype) -> GemmPlan | None:
    """The kernel's view of this product, or None when it runs through XLA (dtypes the kernel
    does not take, an empty product, or operands that cannot be read in place)."""
    if not _kernel_dtypes(lhs_aval.dtype, rhs_aval.dtype, out_dtype):
        return None
    return gemm_plan.plan(lhs_aval.shape, rhs_aval.shape, dimension_numbers)


def out_strides(plan: GemmPlan) -> tuple[int, ...]:
    """Strides of D (elements) that a TMA store steps by: rows, and batch entries where there
    is more than one. (Split-K partial products lie batch * M * N apart, a multiple of these.)"""
    strides = [plan.d_m_stride]
    if plan.batch > 1:
        strides.append(plan.d_batch_stride)
    return tuple(strides)


def config_for(plan: GemmPlan, out_dtype, config: GemmConfig | None) -> GemmConfig:
    """`config`, checked against the product, or the heuristic's choice."""
    out_dtype = jnp.dtype(out_dtype)
    if config is None:
        return default_config(plan.m, plan.n, plan.k, _num_sms(), out_dtype, batch=plan.batch,
                              out_strides=out_strides(plan),
                              misaligned_rows=plan.misaligned_rows,
                              dram_bytes_per_s=_dram_bytes_per_s(), l2_bytes=_l2_bytes())
    check_config(config, plan.m, plan.n, plan.k, out_dtype, out_strides(plan))
    return config


# --------------------------------------------------------------------------------------
# The primitive.

dot_general_p = Primitive("jax_tma_dot_general")


def _abstract_eval(lhs, rhs, *, dimension_numbers, out_dtype, config, local):
    del config, local
    return jax.core.ShapedArray(output_shape(lhs.shape, rhs.shape, dimension_numbers), out_dtype)


def _reference(lhs, rhs, *, dimension_numbers, out_dtype, config, local):
    del config, local
    return lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=out_dtype)


@functools.cache
def _jitted_bind(**params):
    return jax.jit(functools.partial(dot_general_p.bind, **params))


def _impl(lhs, rhs, **params):
    return _jitted_bind(**params)(lhs, rhs)


def _pad(x: jax.Array, view: gemm_plan.OperandView) -> jax.Array:
    if not view.pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[view.pad_axis] = (0, view.pad)
    return jnp.pad(x, widths)


def _kernel_call(lhs, rhs, *, plan: GemmPlan, dimension_numbers, out_dtype, config, poison=False):
    """The FFI call for `plan`: pads rows that are not 16-byte multiples, runs the kernel and
    sums split-K partial products. With `poison`, the kernel writes over NaN-filled buffers
    (tests)."""
    out_dtype = jnp.dtype(out_dtype)
    out_shape = output_shape(lhs.shape, rhs.shape, dimension_numbers)
    lhs, rhs = _pad(lhs, plan.lhs), _pad(rhs, plan.rhs)
    cfg = config_for(plan, out_dtype, config)
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
                 jax.ShapeDtypeStruct((cfg.stream_k_workspace_bytes(_num_sms()),), jnp.uint8))
    if poison:
        d, _ = jax.ffi.ffi_call(KERNEL_TARGET + "_into", out_types, input_output_aliases={2: 0})(
            lhs, rhs, jnp.full(d_shape, jnp.nan, d_dtype), **attrs
        )
    else:
        d, _ = jax.ffi.ffi_call(KERNEL_TARGET, out_types)(lhs, rhs, **attrs)
    if splits > 1:
        d = jnp.sum(d, axis=0).astype(out_dtype)
    return d


def _local_lowering(ctx, lhs, rhs, *, platform: str, **params):
    """Lowering of one device's product: the kernel where it applies, else XLA's dot."""
    plan = None
    if platform == "cuda" and _ext.cuda_lowering_blocker() is None:
        plan = kernel_plan(*ctx.avals_in, params["dimension_numbers"], params["out_dtype"])
    if plan is None:
        fn = functools.partial(_reference, **params)
    else:
        fn = functools.partial(
            _kernel_call, plan=plan, dimension_numbers=params["dimension_numbers"],
            out_dtype=params["out_dtype"], config=params["config"],
        )
    return mlir.lower_fun(fn, multiple_results=False)(ctx, lhs, rhs)


def _lowering(ctx, lhs, rhs, *, platform: str, **params):
    if params["local"]:
        return _local_lowering(ctx, lhs, rhs, platform=platform, **params)
    # The partitioner splits the product across devices; each device's share binds the
    # primitive again with local=True.
    partitioned = functools.partial(
        gemm_sharding.partitioned_dot, local_dot=_bind_local,
        dimension_numbers=params["dimension_numbers"], out_dtype=params["out_dtype"],
        config=params["config"],
    )
    return mlir.lower_fun(partitioned, multiple_results=False)(ctx, lhs, rhs)


def _bind_local(lhs, rhs, dimension_numbers, out_dtype, config):
    return dot_general_p.bind(lhs, rhs, dimension_numbers=dimension_numbers, out_dtype=out_dtype,
                              config=config, local=True)


def _bind(lhs, rhs, dimension_numbers, out_dtype, local=False):
    # Products derived by the rules (gradients, vmapped products) have their own shapes:
    # the heuristic picks their configuration.
    return dot_general_p.bind(lhs, rhs, dimension_numbers=dimension_numbers,
                              out_dtype=jnp.dtype(out_dtype), config=None, local=local)


# ---------------------------------------------------------------- autodiff


def _ranks(x) -> int:
    return len(x.aval.shape) if hasattr(x, "aval") else np.ndim(x)


def _transpose_to(result: jax.Array, axes: list[int]) -> jax.Array:
    """Result whose dimension i holds axis axes[i] of the target, put in target order."""
    perm = tuple(int(i) for i in np.argsort(axes))
    return result if perm == tuple(range(len(perm))) else lax.transpose(result, perm)


def _transpose_lhs(g, x, y, *, dimension_numbers, out_dtype, config, local):
    """Cotangent of lhs: g contracted with rhs over rhs's free dims, batch dims kept."""
    del out_dtype, config
    (xc, yc), (xb, yb) = dimension_numbers
    x_ndim, y_ndim = len(x.aval.shape), _ranks(y)
    x_free, y_free = free_axes(x_ndim, xc, xb), free_axes(y_ndim, yc, yb)
    nb = len(xb)
    g_y_free = tuple(range(nb + len(x_free), nb + len(x_free) + len(y_free)))
    dims = ((g_y_free, tuple(y_free)), (tuple(range(nb)), tuple(yb)))
    result = _bind(g, y, dims, x.aval.dtype, local)
    # result: [batch, x's free dims, y's contracting dims in y's axis order]
    axes = [*xb, *x_free, *(xc[yc.index(a)] for a in sorted(yc))]
    return _transpose_to(result, axes)


def _transpose_rhs(g, x, y, *, dimension_numbers, out_dtype, config, local):
    """Cotangent of rhs: lhs contracted with g over lhs's free dims, batch dims kept."""
    del out_dtype, config
    (xc, yc), (xb, yb) = dimension_numbers
    x_ndim, y_ndim = _ranks(x), len(y.aval.shape)
    x_free, y_free = free_axes(x_ndim, xc, xb), free_axes(y_ndim, yc, yb)
    nb = len(xb)
    g_x_free = tuple(range(nb, nb + len(x_free)))
    dims = ((tuple(x_free), g_x_free), (tuple(xb), tuple(range(nb))))
    result = _bind(x, g, dims, y.aval.dtype, local)
    # result: [batch, x's contracting dims in x's axis order, y's free dims]
    axes = [*yb, *(yc[xc.index(a)] for a in sorted(xc)), *y_free]
    return _transpose_to(result, axes)


# ---------------------------------------------------------------- batching


def _batch_rule(args, dims, *, dimension_numbers, out_dtype, config, local):
    """vmap: a mapped axis of both operands joins the batch dims; a mapped axis of one
    operand becomes one of its free dims (the kernel folds it into M or a batch axis)."""
    del config
    lhs, rhs = args
    ld, rd = dims
    (lc, rc), (lb, rb) = dimension_numbers

    def shift(axes, inserted):
        return tuple(a + (a >= inserted) for a in axes)

    if ld is not None and rd is not None:
        new = ((shift(lc, ld), shift(rc, rd)), ((ld, *shift(lb, ld)), (rd, *shift(rb, rd))))
        return _bind(lhs, rhs, new, out_dtype, local), 0
    if ld is not None:
        lc, lb = shift(lc, ld), shift(lb, ld)
        free = free_axes(lhs.ndim, lc, lb)
        out_dim = len(lb) + free.index(ld)
        return _bind(lhs, rhs, ((lc, rc), (lb, rb)), out_dtype, local), out_dim
    rc, rb = shift(rc, rd), shift(rb, rd)
    free = free_axes(rhs.ndim, rc, rb)
    lhs_free = lhs.ndim - len(lc) - len(lb)
    out_dim = len(lb) + lhs_free + free.index(rd)
    return _bind(lhs, rhs, ((lc, rc), (lb, rb)), out_dtype, local), out_dim


dot_general_p.def_impl(_impl)
# NOTE: the lowering emits custom_partitioning, which needs the device assignment while
# lowering; jit provides it only for primitives in this set (jax has no public hook for it).
dispatch.prim_requires_devices_during_lowering.add(dot_general_p)
dot_general_p.def_abstract_eval(_abstract_eval)
ad.defbilinear(dot_general_p, _transpose_lhs, _transpose_rhs)
batching.primitive_batchers[dot_general_p] = _batch_rule
mlir.register_lowering(dot_general_p, functools.partial(_lowering, platform="default"))
mlir.register_lowering(dot_general_p, functools.partial(_lowering, platform="cuda"),
                       platform="cuda")


# --------------------------------------------------------------------------------------
# Public ops.


def _normalize(dimension_numbers, lhs_ndim: int, rhs_ndim: int) -> DimensionNumbers:
    (lc, rc), (lb, rb) = dimension_numbers

    def axes(seq, ndim):
        return tuple(int(a) % ndim for a in seq)

    return ((axes(lc, lhs_ndim), axes(rc, rhs_ndim)), (axes(lb, lhs_ndim), axes(rb, rhs_ndim)))


def dot_general(lhs: Any, rhs: Any, dimension_numbers, precision=None,
                preferred_element_type=None, *, out_sharding=None,
                config: GemmConfig | None = None) -> jax.Array:
    """``jax.lax.dot_general`` on the Hopper TMA kernel where it applies.

    Same signature, results, dtypes and errors as ``lax.dot_general``, so it can be passed as
    ``dot_general=`` to ``flax.linen.Dense``, ``DenseGeneral``, ``flax.nnx.Linear`` and
    ``LinearGeneral``. bf16 or fp16 operands of one dtype with an output of that dtype or fp32
    run the kernel (fp32 accumulation; `precision` changes nothing for 16-bit inputs) when
    each operand's batch, free and contracting dimensions are runs of adjacent axes and its
    rows are 16-byte multiples (else padded once); transposed operands are read in place.
    Other inputs, and calls with `out_sharding`, run ``lax.dot_general``.

    Args:
      lhs, rhs: arrays.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``.
      precision, preferred_element_type, out_sharding: as for ``lax.dot_general``.
      config: a ``GemmConfig`` for this product (not for the products of its gradient or of
        ``vmap``, which the heuristic configures); a ValueError names the shapes if it cannot
        compute it.
    """
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"jax_tma.dot_general: config must be a GemmConfig or None, got {config!r}")
    reference = functools.partial(
        lax.dot_general, dimension_numbers=dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type, out_sharding=out_sharding,
    )
    expected = jax.eval_shape(reference, lhs, rhs)  # lax's errors, lax's result type
    _ext.warn_if_unavailable()
    lhs_dtype, rhs_dtype = jnp.result_type(lhs), jnp.result_type(rhs)
    if (out_sharding is not None or math.prod(expected.shape) == 0
            or not _kernel_dtypes(lhs_dtype, rhs_dtype, expected.dtype)):
        return reference(lhs, rhs)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    dims = _normalize(dimension_numbers, lhs.ndim, rhs.ndim)
    if config is not None:
        plan = kernel_plan(lhs, rhs, dims, expected.dtype)
        if plan is not None:
            config_for(plan, expected.dtype, config)
    return dot_general_p.bind(lhs, rhs, dimension_numbers=dims, out_dtype=jnp.dtype(expected.dtype),
                              config=config, local=False)


def matmul(a: Any, b: Any, *, out_dtype: Any = None, config: GemmConfig | None = None) -> jax.Array:
    """Matrix product with ``jnp.matmul`` semantics, on the Hopper TMA kernel where it applies.

    Args:
      a: array of shape [..., M, K] or [K] (any dtype ``jnp.matmul`` accepts).
      b: array of shape [..., K, N] or [K].
      out_dtype: result dtype, as ``preferred_element_type`` of ``jnp.matmul``; by default the
        promoted input dtype.
      config: a ``GemmConfig`` to force a kernel tile configuration; by default a heuristic
        picks one. Ignored where the kernel does not apply.

    Returns:
      ``jnp.matmul(a, b, preferred_element_type=out_dtype)``. bf16/fp16 operands of one dtype
      run the kernel (fp32 accumulation) through ``dot_general``: batch dims of equal shape
      become the kernel's batch axis, batch dims of `a` alone fold into M; other broadcasts
      run through XLA. Errors are ``jnp.matmul``'s.
    """
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"jax_tma.matmul: config must be a GemmConfig or None, got {config!r}")
    expected = jax.eval_shape(
        functools.partial(jnp.matmul, preferred_element_type=out_dtype), a, b
    )
    _ext.warn_if_unavailable()
    a_dtype, b_dtype = jnp.result_type(a), jnp.result_type(b)
    if not _kernel_dtypes(a_dtype, b_dtype, expected.dtype):
        return jnp.matmul(a, b, preferred_element_type=out_dtype)
    a, b = jnp.asarray(a), jnp.asarray(b)
    kw = dict(preferred_element_type=expected.dtype, config=config)
    if a.ndim == 1 and b.ndim == 1:
        return dot_general(a, b, (((0,), (0,)), ((), ())), **kw)
    if b.ndim == 1:
        return dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), **kw)
    if a.ndim == 1:
        return dot_general(a, b, (((0,), (b.ndim - 2,)), ((), ())), **kw)
    if b.ndim == 2:  # a's batch dims fold into M
        return dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), **kw)
    if a.shape[:-2] == b.shape[:-2]:
        batch = tuple(range(a.ndim - 2))
        return dot_general(a, b, (((a.ndim - 1,), (b.ndim - 2,)), (batch, batch)), **kw)
    if a.ndim == 2 and b.ndim == 3:
        # [M, K] @ [B, K, N]: the kernel broadcasts a over b's batch and writes [M, B, N].
        out = dot_general(a, b, (((1,), (1,)), ((), ())), **kw)
        return jnp.moveaxis(out, 1, 0)
    return jnp.matmul(a, b, preferred_element_type=out_dtype)
