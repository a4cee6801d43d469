"""The ragged (grouped GEMM) primitive ``jax_tma_ragged_dot`` behind ``jax_tma.ragged_dot`` and
``ragged_dot_general`` (api.py): a batch of the rows or contraction products (vmap adds to the
batch), with a JVP by bilinearity, transposes that bind the primitive again (the gradient of lhs
is the rows form against rhs read transposed in place; the gradient of rhs is the contraction
form), a batching rule, and sharding through ``custom_partitioning`` (sharding.py). It lowers to
XLA everywhere and, on CUDA, to the ``jax_tma_ragged_dot_sm90`` kernel pair when the operands are
bf16 or fp16 of one type (csrc/contract/sm90_ragged_dot.h): group sizes are read on the device,
never by the host. Group sizes are clamped to [0, M] (the kernel treats negative ones as 0).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, batching

from jax_tma._core.aval import result_aval
from jax_tma._core.primitive import define_primitive, kernel_ffi_call
from jax_tma.ops.gemm.config import KERNEL_INPUT_DTYPES, STRIDE_ELEMS, kernel_output_dtypes
from jax_tma.ops.ragged import sharding as ragged_sharding
from jax_tma.ops.ragged.config import (CONTRACTION, ROWS, clamp_sizes, default_config,
                                       widen_sizes)

KERNEL_TARGET = "jax_tma_ragged_dot_sm90"
_MODE_ATTR = {ROWS: 0, CONTRACTION: 1}
# The kernel numbers rows and work units in int32 (csrc/ffi/ragged_dot.cc).
_INT32_MAX = 2**31 - 1
# sm90_gemm::ragged_workspace_bytes: 128 bytes of alignment slack, 128 per tensor map, 16 per
# segment-table entry (one past the last segment).
_MAP_BYTES, _SEGMENT_BYTES, _ALIGN = 128, 16, 128

def workspace_bytes(mode: str, groups: int, batch: int, maps_per_segment: int | None = None
                    ) -> int:
    """Bytes of the kernel's workspace: tensor maps (by default one per segment in the rows mode,
    two in the contraction mode) and the segment table (sm90_gemm::ragged_workspace_bytes)."""
    segments = batch * (groups + (mode == ROWS))
    if maps_per_segment is None:
        maps_per_segment = 1 if mode == ROWS else 2
    maps = segments * maps_per_segment
    return _ALIGN + maps * _MAP_BYTES + (segments + 1) * _SEGMENT_BYTES


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


def rows_reference(x, w, gs, out_dtype):
    """The rows form in lax: x [B, M, K] times w [Bw, G, K, N] per group -> [B, M, N]."""
    return _reference(x, w, gs, mode=ROWS, w_k_major=False, out_dtype=out_dtype, config=None,
                      local=False)


def rows_product(x, w, gs, out_dtype, local: bool = False):
    """The rows form as this primitive (its JVP and transposes: differentiable to any order)."""
    return _bind(x, w, gs, ROWS, False, out_dtype, local)


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
    return jax.vmap(one)(x, _broadcast_batch(w, batch), _broadcast_batch(widen_sizes(gs), batch))


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """The kernel's view of one call: sizes and the zero padding that makes K's and N's rows whole
    multiples of 16 bytes (TMA's rule; the FP8 grouped product's plan is one too, mode ROWS)."""

    mode: str
    batch: int
    rows: int
    k: int
    n: int
    groups: int
    k_pad: int
    n_pad: int


def call_attrs(cfg, plan: RaggedPlan, n: int, k: int, weights_batched: bool, gs) -> dict:
    """The FFI attributes every grouped kernel's handler reads (ffi/ragged_dot.cc's shared
    checks): the tile configuration, the padded problem and which operands carry a batch."""
    i64 = np.int64
    return dict(block_m=i64(cfg.block_m), block_n=i64(cfg.block_n), stages=i64(cfg.stages),
                cluster_m=i64(cfg.cluster_m), rows=i64(plan.rows), n=i64(n), k=i64(k),
                groups=i64(plan.groups), batch=i64(plan.batch),
                weights_batched=i64(weights_batched), group_sizes_batched=i64(gs.shape[0] > 1))


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
    gs = clamp_sizes(gs, plan.rows)
    cfg = config if config is not None else default_config(
        mode, plan.batch * plan.rows, np_, kp, plan.groups * plan.batch, out_dtype=out_dtype)
    out_shape = ((plan.batch, plan.rows, np_) if mode == ROWS
                 else (plan.batch, plan.groups, kp, np_))
    attrs = dict(call_attrs(cfg, plan, np_, kp, mode == ROWS and w.shape[0] > 1, gs),
                 mode=np.int64(_MODE_ATTR[mode]), w_k_major=np.int64(mode == ROWS and w_k_major))
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


def fold_vmapped(args, dims, shared_ok) -> tuple[list, int, int]:
    """vmap of a primitive over operands with a leading batch dim (x [B, ...] first): the mapped
    axis joins each operand's batch dim ([V*B, ...]); an unmapped operand of batch 1 stays
    shared where `shared_ok` says it may (weights, group sizes); anything else is broadcast.
    Returns the folded operands, V and B."""
    x = args[0]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    batch = x.shape[0] if dims[0] is None else jnp.moveaxis(x, dims[0], 0).shape[1]

    def merged(v, d, ok: bool):
        if d is None:
            if ok and v.shape[0] == 1:
                return v  # shared by every (new and old) batch entry
            v = jnp.broadcast_to(v[None], (size, *v.shape))
        else:
            v = jnp.moveaxis(v, d, 0)
        if v.shape[1] != batch:  # shared along the old batch only: repeat it per entry
            v = jnp.broadcast_to(v, (size, batch, *v.shape[2:]))
        return v.reshape(size * batch, *v.shape[2:])

    return [merged(v, d, ok) for v, d, ok in zip(args, dims, shared_ok)], size, batch


def _batch_rule(args, dims, *, mode, w_k_major, out_dtype, config, local):
    """vmap: the mapped axis joins each operand's batch dim (x [V*B, M, K]); an unmapped weight
    or group-size operand shared by the batch stays shared; anything else is broadcast."""
    del config
    (x2, w2, gs2), size, batch = fold_vmapped(args, dims, (False, mode == ROWS, True))
    out = _bind(x2, w2, gs2, mode, w_k_major, out_dtype, local)
    return out.reshape(size, batch, *out.shape[1:]), 0


ragged_dot_p = define_primitive("jax_tma_ragged_dot", abstract_eval=_abstract_eval,
                                reference=_reference, kernel_fn=_kernel_fn,
                                partitioned=_partitioned)
ad.primitive_jvps[ragged_dot_p] = _jvp
ad.primitive_transposes[ragged_dot_p] = _transpose
batching.primitive_batchers[ragged_dot_p] = _batch_rule
