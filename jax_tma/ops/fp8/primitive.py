"""The FP8 product primitive ``jax_tma_fp8_dot`` behind ``jax_tma.fp8_dot_general`` and
``fp8_matmul`` (api.py): operands K-major, block scales in the layouts quantize_fp8 writes,
row / column scales and the bias in the epilogue; its XLA reference (dequantise, fp32 dot), vmap
and sharding through ``custom_partitioning`` (sharding.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import batching

from jax_tma import _ext
from jax_tma._core import device
from jax_tma._core.aval import result_aval
from jax_tma._core.primitive import (bind_local, define_primitive, kernel_ffi_call,
                                     sum_split_partials)
from jax_tma.ops.fp8 import sharding as fp8_sharding
from jax_tma.ops.fp8 import tuned
from jax_tma.ops.fp8.config import FP8_DTYPES, OUT_DTYPES, SCALE_BLOCK
from jax_tma.ops.fp8.quantize import _pad_to, widen_fp8

KERNEL_TARGET = "jax_tma_fp8_gemm_sm90"
# Kernel limits: operand rows of 16 bytes (K), output rows of 16 bytes (N, bf16), scale rows of
# 16 bytes (M and ceil(N / 128) for the block scales' rows, padded where not).
_K_MULTIPLE, _N_MULTIPLE, _SCALE_ROW_MULTIPLE = 16, 8, 4
# The epilogue's scale vectors (attribute values of ffi/fp8.cc).
NONE, SCALAR, VECTOR = "none", "scalar", "vector"
_VECTOR_CODE = {NONE: 0, SCALAR: 1, VECTOR: 2}


# --------------------------------------------------------------------------------------
# The primitive: a [M, K] and b [N, K] FP8 (K-major), then where present sa [Kb, M] (block),
# sb [Kb, Nb] (block), row_scale ([] or [M]), col_scale ([] or [N]), bias [N]; out [M, N].

def _split(rest, has_sa, has_sb, row_scale, col_scale, has_bias):
    rest = list(rest)
    take = lambda present: rest.pop(0) if present else None  # noqa: E731
    return (take(has_sa), take(has_sb), take(row_scale != NONE), take(col_scale != NONE),
            take(has_bias))


def _abstract_eval(a, b, *rest, out_dtype, **params):
    del params
    return result_aval((a.shape[0], b.shape[0]), out_dtype, a, b, *rest)


def _reference(a, b, *rest, has_sa, has_sb, row_scale, col_scale, has_bias, out_dtype, config,
               local, promote):
    """What the kernel computes, in XLA: the dequantised operands' product in fp32, the
    epilogue's scales and bias, one rounding."""
    del config, local, promote
    sa, sb, rs, cs, bias = _split(rest, has_sa, has_sb, row_scale, col_scale, has_bias)
    a32, b32 = widen_fp8(a), widen_fp8(b)
    k = a.shape[1]
    if sa is not None:  # [Kb, M] -> [M, K]
        a32 = a32 * jnp.repeat(sa.T, SCALE_BLOCK, axis=1)[:, :k]
    if sb is not None:  # [Kb, Nb] -> [N, K]
        s = jnp.repeat(jnp.repeat(sb.T, SCALE_BLOCK, axis=0), SCALE_BLOCK, axis=1)
        b32 = b32 * s[: b.shape[0], :k]
    out = lax.dot_general(a32, b32, (((1,), (1,)), ((), ())),
                          precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if rs is not None:
        out = out * (rs[:, None] if rs.ndim else rs)
    if cs is not None:
        out = out * cs
    if bias is not None:
        out = out + bias
    return out.astype(out_dtype)


def kernel_enabled() -> bool:
    """Whether the FP8 kernel may run: yes unless ``JAX_TMA_FP8_KERNEL`` says no (then the fp8
    ops lower to XLA's reference of the same math: dequantise, fp32 dot). ``JAX_TMA_DISABLE``
    turns every kernel off, this one included."""
    return _ext.env_flag("JAX_TMA_FP8_KERNEL", default=True, on="to use the FP8 kernel",
                         off="to lower the FP8 ops to XLA's reference")


def kernel_applies(a, b, out_dtype) -> bool:
    """Whether the FP8 kernel computes a product of these operands (avals or arrays): one FP8
    type for both, bf16 or fp32 out, sizes in the kernel's range."""
    dtype = jnp.dtype(a.dtype)
    if dtype not in FP8_DTYPES or jnp.dtype(b.dtype) != dtype:
        return False
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        return False
    m, k = a.shape
    n = b.shape[0]
    return min(m, n, k) >= 1 and max(m, n, k) < 2**30


def _kernel_call(a, b, *rest, has_sa, has_sb, row_scale, col_scale, has_bias, out_dtype,
                 config, promote=True, poison=False):
    """The FFI call: pads K to 16-byte rows, N to 8 and the block scales' rows to 16 bytes,
    runs the kernel (split-K: fp32 partial products summed here, the bias added after;
    stream-K: its workspace is the call's second result, unused after it)."""
    sa, sb, rs, cs, bias = _split(rest, has_sa, has_sb, row_scale, col_scale, has_bias)
    m, k = a.shape
    n = b.shape[0]
    out_dtype = jnp.dtype(out_dtype)
    cfg = config if config is not None else tuned.config_for(
        tuned.Product(m, n, k, a.dtype, out_dtype, promote, has_sa or has_sb))
    a = _pad_to(a, 1, _K_MULTIPLE)
    b = _pad_to(_pad_to(b, 1, _K_MULTIPLE), 0, _N_MULTIPLE)
    n_pad = b.shape[0]
    if cs is not None and cs.ndim:
        cs = _pad_to(cs, 0, _N_MULTIPLE)
    if bias is not None:
        bias = _pad_to(bias, 0, _N_MULTIPLE)
    nb = -(-n_pad // SCALE_BLOCK)
    f32 = jnp.float32
    placeholder = jnp.zeros((1,), f32)
    sa = _pad_to(sa, 1, _SCALE_ROW_MULTIPLE) if sa is not None else placeholder
    if sb is not None and sb.shape[1] < nb:  # N padded past a block edge: scale never used
        sb = jnp.pad(sb, ((0, 0), (0, nb - sb.shape[1])))
    sb = _pad_to(sb, 1, _SCALE_ROW_MULTIPLE) if sb is not None else placeholder
    splits = cfg.splits_for(k)
    d_dtype = jnp.dtype(f32) if splits > 1 else out_dtype
    d_shape = (splits, m, n_pad)
    i64 = np.int64
    attrs = dict(
        block_m=i64(cfg.block_m), block_n=i64(cfg.block_n), stages=i64(cfg.stages),
        cluster_m=i64(cfg.cluster_m), promote=i64(promote), splits=i64(splits),
        stream_k=i64(cfg.stream_k), m=i64(m), n=i64(n_pad), k=i64(a.shape[1]), batch=i64(1),
        a_batched=i64(0), b_batched=i64(0), sa_ld=i64(sa.shape[1] if has_sa else 4),
        sb_ld=i64(sb.shape[1] if has_sb else 4), has_sa=i64(has_sa), has_sb=i64(has_sb),
        row_scale=i64(_VECTOR_CODE[row_scale]), col_scale=i64(_VECTOR_CODE[col_scale]),
        has_bias=i64(has_bias and splits == 1))
    operands = (a, b, sa, sb, placeholder if rs is None else rs.reshape(-1),
                placeholder if cs is None else cs.reshape(-1),
                bias if bias is not None and splits == 1 else placeholder)
    out_types = (jax.ShapeDtypeStruct(d_shape, d_dtype),
                 jax.ShapeDtypeStruct((cfg.stream_k_workspace_bytes(device.num_sms()),),
                                      jnp.uint8))
    d, _ = kernel_ffi_call(KERNEL_TARGET, out_types, operands, attrs, poison=poison)
    if splits > 1:
        d = sum_split_partials(d)
        if bias is not None:
            d = d + bias
        return d[:, :n].astype(out_dtype)
    return d[0, :, :n] if n_pad != n else d.reshape(m, n)


def _kernel_fn(avals_in, params):
    """The FP8 kernel's call, or None where the reference runs (XLA)."""
    if not (kernel_enabled() and kernel_applies(avals_in[0], avals_in[1], params["out_dtype"])):
        return None
    return functools.partial(_kernel_call, **{k: v for k, v in params.items() if k != "local"})


def _partitioned(params):
    return functools.partial(fp8_sharding.partitioned_fp8_dot, local_op=_bind_local,
                             params=params)


def _batch_rule(args, dims, **params):
    """vmap: mapped axes of a, its block scales and row scales fold into M (one kernel); a
    mapped b side (b, its scales, column scales, bias) runs the reference, batched in XLA."""
    a, b, *rest = args
    a_dims, b_dims = dims[0], dims[1]
    sa, sb, rs, cs, bias = _split(rest, params["has_sa"], params["has_sb"],
                                  params["row_scale"], params["col_scale"], params["has_bias"])
    rest_dims = list(dims[2:])
    d_sa, d_sb, d_rs, d_cs, d_bias = _split(rest_dims, params["has_sa"],
                                            params["has_sb"], params["row_scale"],
                                            params["col_scale"], params["has_bias"])
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    b_side_mapped = any(d is not None for d in (b_dims, d_sb, d_cs, d_bias))
    if b_side_mapped:
        moved = [jnp.moveaxis(x, d, 0) if d is not None else
                 jnp.broadcast_to(x, (size, *x.shape)) for x, d in zip(args, dims)]
        return jax.vmap(functools.partial(_reference, **params))(*moved), 0

    def mapped(x, d):
        return jnp.moveaxis(x, d, 0) if d is not None else jnp.broadcast_to(x, (size, *x.shape))

    a = mapped(a, a_dims)
    m = a.shape[1]
    flat = [a.reshape(size * m, -1), b]
    if sa is not None:  # [size, Kb, M] -> [Kb, size * M]
        s = mapped(sa, d_sa)
        flat.append(jnp.moveaxis(s, 0, 1).reshape(s.shape[1], size * m))
    if sb is not None:
        flat.append(sb)
    row_scale = params["row_scale"]
    if rs is not None:
        if d_rs is None and row_scale == SCALAR:
            flat.append(rs)
        else:  # per-entry scalars or rows: one vector over the folded rows
            r = mapped(rs, d_rs)
            flat.append(jnp.broadcast_to(r.reshape(size, -1), (size, m)).reshape(size * m))
            row_scale = VECTOR
    flat += [x for x in (cs, bias) if x is not None]
    out = fp8_dot_p.bind(*flat, **{**params, "row_scale": row_scale})
    return out.reshape(size, m, -1), 0


fp8_dot_p = define_primitive("jax_tma_fp8_dot", abstract_eval=_abstract_eval,
                             reference=_reference, kernel_fn=_kernel_fn,
                             partitioned=_partitioned)
_bind_local = bind_local(fp8_dot_p)
batching.primitive_batchers[fp8_dot_p] = _batch_rule

