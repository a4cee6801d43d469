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
(jax_tma/ragged_sharding.py). It lowers to XLA everywhere and, on CUDA, to the
``jax_tma_ragged_dot_sm90`` kernel pair when the operands are bf16 or fp16 of one type
(csrc/kernels/sm90_ragged_dot.h): group sizes are read on the device, never by the host.

Group sizes are clamped to [0, M], and the rows of the groups after the running sum reaches M are
cut off, as ``lax.ragged_dot`` computes them for sizes that sum to at most M. (``lax`` gives
meaning to negative sizes by overlapping groups; the kernel treats them as 0.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, batching

from jax_tma import _ext, ragged_sharding
from jax_tma._core import device
from jax_tma._core.aval import result_aval
from jax_tma._core.primitive import define_primitive, kernel_ffi_call
from jax_tma.gemm_config import (KERNEL_INPUT_DTYPES, STRIDE_ELEMS, GemmConfig, as_config,
                                 estimate_seconds, kernel_output_dtypes)

KERNEL_TARGET = "jax_tma_ragged_dot_sm90"
ROWS, CONTRACTION = "rows", "contraction"
_MODE_ATTR = {ROWS: 0, CONTRACTION: 1}
# (block_m, block_n, stages, cluster_m) of JAX_TMA_SM90_RAGGED_TILES
# (csrc/kernels/sm90_ragged_dot.h).
_RAGGED_TILES = ((128, 256, 3, 2), (128, 192, 4, 2), (128, 128, 6, 1), (64, 256, 4, 1),
                 (64, 128, 8, 1))
RAGGED_CONFIGS: tuple[GemmConfig, ...] = tuple(GemmConfig(*t) for t in _RAGGED_TILES)
# The kernel numbers rows and work units in int32 (csrc/ffi/ragged_dot.cc).
_INT32_MAX = 2**31 - 1
# sm90_gemm::ragged_workspace_bytes: 128 bytes of alignment slack, 128 per tensor map, 16 per
# segment-table entry (one past the last segment).
_MAP_BYTES, _SEGMENT_BYTES, _ALIGN = 128, 16, 128

# lax.ragged_dot's dimension numbers: lhs [M, K], rhs [G, K, N].
RAGGED_DOT_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def workspace_bytes(mode: str, groups: int, batch: int) -> int:
    """Bytes of the kernel's workspace: tensor maps and the segment table
    (sm90_gemm::ragged_workspace_bytes)."""
    segments = batch * (groups + (mode == ROWS))
    maps = segments * (1 if mode == ROWS else 2)
    return _ALIGN + maps * _MAP_BYTES + (segments + 1) * _SEGMENT_BYTES


def _check_config(config: GemmConfig) -> None:
    if config.tile not in _RAGGED_TILES or config.split_k != 1 or config.stream_k:
        choices = "; ".join(c.describe() for c in RAGGED_CONFIGS)
        raise ValueError(f"jax_tma.ragged_dot: GemmConfig({config.describe()}) is not compiled "
                         f"for ragged products; choose one of: {choices}")


def default_config(mode: str, rows: int, n: int, k: int, groups: int,
                   num_sms: int | None = None, out_dtype=jnp.bfloat16) -> GemmConfig:
    """The compiled ragged tile with the least estimated time, groups assumed of equal size.

    rows mode: G products of (rows / G) x n x k, each reading its own weights; contraction mode:
    G products of k x n contracted over rows / G. Both are scored by the dense GEMM's cost model
    (gemm_config.estimate_seconds) as a batch of G products; ties go to the deeper pipeline,
    then the cluster of 2."""
    num_sms = device.num_sms() if num_sms is None else num_sms
    per_group = max(1, -(-rows // groups))
    m, kk = (per_group, k) if mode == ROWS else (k, per_group)
    best, best_key = None, None
    for cfg in RAGGED_CONFIGS:
        seconds = estimate_seconds(cfg, m, n, kk, num_sms, jnp.dtype(out_dtype).itemsize,
                                   batch=groups, dram_bytes_per_s=device.dram_bytes_per_s(),
                                   l2_bytes=device.l2_bytes())
        key = (round(seconds, 9), -cfg.stages, -cfg.cluster_m)
        if best_key is None or key < best_key:
            best, best_key = cfg, key
    return best


# --------------------------------------------------------------------------------------
# The primitive: x [B, M, K]; rows mode: w [Bw, G, K, N] (or [Bw, G, N, K] with w_k_major),
# out [B, M, N]; contraction mode: w is dy [B, M, N], out [B, G, K, N]. Bw and the group sizes'
# leading dim are 1 (shared by every batch entry) or B.

def _out_shape(x_shape, w_shape, gs_shape, mode, w_k_major):
    b, m, k = x_shape
    if mode == ROWS:
        n = w_shape[2] if w_k_major else w_shape[3]
        return (b, m, n)
    return (b, gs_shape[-1], k, w_shape[2])


def _abstract_eval(x, w, gs, *, mode, w_k_major, out_dtype, config, local):
    del config, local
    return result_aval(_out_shape(x.shape, w.shape, gs.shape, mode, w_k_major), out_dtype,
                       x, w, gs)


def _broadcast_batch(v, batch):
    return v if v.shape[0] == batch else jnp.broadcast_to(v, (batch, *v.shape[1:]))


def _reference(x, w, gs, *, mode, w_k_major, out_dtype, config, local):
    """The product through lax.ragged_dot_general, one batch entry at a time under vmap."""
    del config, local
    batch = x.shape[0]
    if mode == ROWS:
        dims = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [2 if w_k_major else 1]), ([], [])),
            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    else:
        dims = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[])
    one = functools.partial(lax.ragged_dot_general, ragged_dot_dimension_numbers=dims,
                            preferred_element_type=out_dtype)
    # NOTE: lax batches ragged_dot only with every operand mapped.
    return jax.vmap(one)(x, _broadcast_batch(w, batch), _broadcast_batch(gs, batch))


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """The kernel's view of one call: sizes and the zero padding that makes K and N multiples of
    8 elements (TMA's 16-byte rows)."""

    mode: str
    batch: int
    rows: int
    k: int
    n: int
    groups: int
    k_pad: int
    n_pad: int


def kernel_plan(x, w, gs, mode: str, w_k_major: bool, out_dtype) -> RaggedPlan | None:
    """The kernel's view of the product, or None when it runs through XLA: operands not bf16 or
    fp16 of one type, an output not their type or fp32, an empty product, or sizes past the
    kernel's int32 numbering."""
    in_dtype = jnp.dtype(x.dtype)
    if (in_dtype != jnp.dtype(w.dtype) or in_dtype not in KERNEL_INPUT_DTYPES
            or jnp.dtype(out_dtype) not in kernel_output_dtypes(in_dtype)):
        return None
    batch, rows, k = x.shape
    groups = gs.shape[-1]
    n = _out_shape(x.shape, w.shape, gs.shape, mode, w_k_major)[-1]
    if min(batch, rows, k, n, groups) < 1:
        return None
    k_pad, n_pad = -k % STRIDE_ELEMS, -n % STRIDE_ELEMS
    kp, np_ = k + k_pad, n + n_pad
    stacked = batch * rows
    if (max(stacked, kp, np_) > _INT32_MAX or batch * groups > _INT32_MAX // 2
            or (stacked // 64 + batch * (groups + 1)) * -(-np_ // 128) > _INT32_MAX // 2
            or -(-kp // 64) * -(-np_ // 128) * batch * groups > _INT32_MAX // 2):
        return None
    return RaggedPlan(mode, batch, rows, k, n, groups, k_pad, n_pad)


def _pad_axis(v, axis: int, pad: int):
    if not pad:
        return v
    widths = [(0, 0)] * v.ndim
    widths[axis] = (0, pad)
    return jnp.pad(v, widths)


def _kernel_call(x, w, gs, *, plan: RaggedPlan, w_k_major: bool, out_dtype, config,
                 poison: bool = False):
    """The FFI call for `plan`: K and N padded with zeros to multiples of 8 where needed, group
    sizes as int32 clamped to [0, M]. With `poison` the kernel writes over a NaN-filled output
    (tests)."""
    out_dtype = jnp.dtype(out_dtype)
    mode = plan.mode
    x = _pad_axis(x, 2, plan.k_pad)
    if mode == ROWS:
        w = _pad_axis(w, 3 if w_k_major else 2, plan.k_pad)
        w = _pad_axis(w, 2 if w_k_major else 3, plan.n_pad)
    else:
        w = _pad_axis(w, 2, plan.n_pad)
    kp, np_ = plan.k + plan.k_pad, plan.n + plan.n_pad
    gs = jnp.clip(gs, 0, plan.rows).astype(jnp.int32)
    cfg = config if config is not None else default_config(
        mode, plan.batch * plan.rows, np_, kp, plan.groups * plan.batch, out_dtype=out_dtype)
    out_shape = ((plan.batch, plan.rows, np_) if mode == ROWS
                 else (plan.batch, plan.groups, kp, np_))
    i64 = np.int64
    attrs = dict(
        mode=i64(_MODE_ATTR[mode]), block_m=i64(cfg.block_m), block_n=i64(cfg.block_n),
        stages=i64(cfg.stages), cluster_m=i64(cfg.cluster_m), rows=i64(plan.rows), n=i64(np_),
        k=i64(kp), groups=i64(plan.groups), batch=i64(plan.batch),
        weights_batched=i64(mode == ROWS and w.shape[0] > 1),
        group_sizes_batched=i64(gs.shape[0] > 1), w_k_major=i64(mode == ROWS and w_k_major),
    )
    out_types = (jax.ShapeDtypeStruct(out_shape, out_dtype),
                 jax.ShapeDtypeStruct((workspace_bytes(mode, plan.groups, plan.batch),),
                                      jnp.uint8))
    out, _ = kernel_ffi_call(KERNEL_TARGET, out_types, (x, w, gs), attrs, poison=poison)
    if plan.k_pad and mode == CONTRACTION:
        out = out[:, :, :plan.k]
    if plan.n_pad:
        out = out[..., :plan.n]
    return out


def _kernel_fn(avals_in, params):
    """The kernel call of one device's product, or None where lax's form runs it."""
    plan = kernel_plan(*avals_in, params["mode"], params["w_k_major"], params["out_dtype"])
    if plan is None:
        return None
    return functools.partial(_kernel_call, plan=plan, w_k_major=params["w_k_major"],
                             out_dtype=params["out_dtype"], config=params["config"])


def _partitioned(params):
    return functools.partial(
        ragged_sharding.partitioned_ragged_dot, local_op=_bind_local, mode=params["mode"],
        w_k_major=params["w_k_major"], out_dtype=params["out_dtype"], config=params["config"])


def _bind_local(x, w, gs, mode, w_k_major, out_dtype, config):
    return ragged_dot_p.bind(x, w, gs, mode=mode, w_k_major=w_k_major, out_dtype=out_dtype,
                             config=config, local=True)


def _bind(x, w, gs, mode, w_k_major, out_dtype, local=False):
    # Products derived by the rules have their own shapes: the heuristic configures them.
    return ragged_dot_p.bind(x, w, gs, mode=mode, w_k_major=bool(w_k_major),
                             out_dtype=jnp.dtype(out_dtype), config=None, local=local)


# ---------------------------------------------------------------- autodiff


def _jvp(primals, tangents, *, mode, w_k_major, out_dtype, config, local):
    x, w, gs = primals
    dx, dw, _ = tangents
    params = dict(mode=mode, w_k_major=w_k_major, out_dtype=out_dtype, config=config,
                  local=local)
    out = ragged_dot_p.bind(x, w, gs, **params)
    terms = []
    if type(dx) is not ad.Zero:
        terms.append(ragged_dot_p.bind(dx, w, gs, **params))
    if type(dw) is not ad.Zero:
        terms.append(ragged_dot_p.bind(x, dw, gs, **params))
    if not terms:
        return out, ad.Zero.from_primal_value(out)
    return out, functools.reduce(jnp.add, terms)


def _sum_to_batch(v, batch: int):
    """A cotangent [B, ...] summed over the batch when its primal was shared (batch 1)."""
    return v if batch == v.shape[0] else jnp.sum(v, axis=0, keepdims=True, dtype=v.dtype)


def _transpose(ct, x, w, gs, *, mode, w_k_major, out_dtype, config, local):
    """Cotangents of the linear operand (x or w): more ragged products, operands in place."""
    del out_dtype, config
    if type(ct) is ad.Zero:
        return None, None, None
    if ad.is_undefined_primal(x):
        x_aval = x.aval
        if mode == ROWS:
            # dx[rows of g] = ct[rows of g] @ w[g]^T: w read with the other major.
            dx = _bind(ct, w, gs, ROWS, not w_k_major, x_aval.dtype, local)
        else:
            # out[g] = x[g]^T @ dy[g]: dx[rows of g] = dy[rows of g] @ ct[g]^T, ct [B, G, K, N]
            # read as [G, K, N] K-major weights.
            dx = _bind(w, ct, gs, ROWS, True, x_aval.dtype, local)
        return _sum_to_batch(dx, x_aval.shape[0]).astype(x_aval.dtype), None, None
    w_aval = w.aval
    if mode == ROWS:
        # dw[g] = x[rows of g]^T @ ct[rows of g] ([G, K, N]); stored [G, N, K]: ct^T @ x.
        dw = (_bind(ct, x, gs, CONTRACTION, False, w_aval.dtype, local) if w_k_major
              else _bind(x, ct, gs, CONTRACTION, False, w_aval.dtype, local))
    else:
        # out[g] = x[g]^T @ dy[g]: ddy[rows of g] = x[rows of g] @ ct[g].
        dw = _bind(x, ct, gs, ROWS, False, w_aval.dtype, local)
    return None, _sum_to_batch(dw, w_aval.shape[0]).astype(w_aval.dtype), None


# ---------------------------------------------------------------- batching


def _batch_rule(args, dims, *, mode, w_k_major, out_dtype, config, local):
    """vmap: the mapped axis joins each operand's batch dim (x [V*B, M, K]); an unmapped weight
    or group-size operand shared by the batch stays shared; anything else is broadcast."""
    del config
    x, w, gs = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    batch = x.shape[0] if dims[0] is None else x.shape[dims[0] + (dims[0] == 0)]

    def merged(v, d, shared_ok: bool):
        if d is None:
            if shared_ok and v.shape[0] == 1:
                return v  # shared by every (new and old) batch entry
            v = jnp.broadcast_to(v[None], (size, *v.shape))
        else:
            v = jnp.moveaxis(v, d, 0)
        if v.shape[1] != batch:  # shared along the old batch only: repeat it per entry
            v = jnp.broadcast_to(v, (size, batch, *v.shape[2:]))
        return v.reshape(size * batch, *v.shape[2:])

    if dims[0] is not None:
        batch = jnp.moveaxis(x, dims[0], 0).shape[1]
    x2 = merged(x, dims[0], False)
    w2 = merged(w, dims[1], mode == ROWS)
    gs2 = merged(gs, dims[2], True)
    out = _bind(x2, w2, gs2, mode, w_k_major, out_dtype, local)
    return out.reshape(size, batch, *out.shape[1:]), 0


ragged_dot_p = define_primitive("jax_tma_ragged_dot", abstract_eval=_abstract_eval,
                                reference=_reference, kernel_fn=_kernel_fn,
                                partitioned=_partitioned)
ad.primitive_jvps[ragged_dot_p] = _jvp
ad.primitive_transposes[ragged_dot_p] = _transpose
batching.primitive_batchers[ragged_dot_p] = _batch_rule


# --------------------------------------------------------------------------------------
# Public ops.


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
    config = as_config(config, "jax_tma.ragged_dot_general")
    if config is not None:
        _check_config(config)
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
