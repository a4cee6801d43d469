"""The block-scaled FP8 grouped primitive ``jax_tma_fp8_ragged_dot`` behind
``jax_tma.fp8_ragged_dot`` (ragged.py): a batch (vmap adds to it) of ragged products of FP8 rows
and per-group K-major FP8 weights, dequantised by their scales and accumulated in fp32. It lowers
to XLA everywhere (dequantise, ``lax.ragged_dot_general`` in fp32) and, on CUDA, to the
``jax_tma_fp8_ragged_dot_sm90`` kernel pair when the operands are e4m3 and the output bf16 or
fp32 (csrc/contract/sm90_fp8_ragged_dot.h): ragged_dot's rows schedule and per-segment output
maps, the FP8 mainloop's promotion every 128 K with the block scales, group sizes read on the
device. Batching folds vmapped axes into the kernel's batch; sharding is ragged_dot's rows form
with K, N and the groups whole (ragged/sharding.py). Gradients are fp8_ragged_dot's custom VJP
(ragged.py: this primitive for dx, the bf16 grouped kernel for dW); the primitive itself has no
JVP (forward-mode differentiation raises).

Operands x [B, M, K], w [Bw, G, N, K] (one FP8 type), group sizes [Bg, G] (Bw, Bg: 1 or B), and
the scales, each either a block scale or one fp32 value (the static ``sa_block`` / ``sb_block``
say which): sa [B, ceil(K / 128), M] (x's rows per 128 K, ``quantize_fp8(x, (1, 128))``'s layout
per entry) or []; sb [Bw, G, ceil(K / 128), ceil(N / 128)] (``quantize_fp8(w, (128, 128))``'s
per weight) or []. Result [B, M, N]; rows past the last group are zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, batching

from jax_tma._core.aval import result_aval
from jax_tma._core.primitive import bind_local, define_primitive, kernel_ffi_call, planned_call
from jax_tma.ops.fp8.config import OUT_DTYPES, SCALE_BLOCK, default_ragged_config
from jax_tma.ops.fp8.primitive import kernel_enabled
from jax_tma.ops.fp8.quantize import _pad_to, dequantize_fp8, widen_fp8
from jax_tma.ops.ragged import sharding as ragged_sharding
from jax_tma.ops.ragged.config import ROWS, clamp_sizes
from jax_tma.ops.ragged.primitive import (_INT32_MAX, RaggedPlan, _pad_axis, call_attrs,
                                         fold_vmapped, workspace_bytes)

KERNEL_TARGET = "jax_tma_fp8_ragged_dot_sm90"
# The FP8 types the kernel is compiled for (e5m2 runs the reference).
KERNEL_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)
# Kernel limits: x's and w's rows of 16 bytes (K), out's rows of 16 bytes (N: 8 bf16), scale
# rows of 16 bytes (sa's over the stacked rows, sb's over N's blocks), padded where not.
_K_MULTIPLE, _N_MULTIPLE, _SCALE_ROW_MULTIPLE = 16, 8, 4


def _blocks(size: int) -> int:
    return -(-size // SCALE_BLOCK)


def _abstract_eval(x, w, gs, sa, sb, *, sa_block, sb_block, out_dtype, config, local):
    del sa_block, sb_block, config, local
    return result_aval((x.shape[0], x.shape[1], w.shape[2]), out_dtype, x, w, gs, sa, sb)


def dequantised(x, w, sa, sb, sa_block: bool, sb_block: bool):
    """x and w in fp32 times their block scales (dequantize_fp8's expansion, batch dims
    leading); one-value scales are left to the product."""
    x32 = dequantize_fp8(x, sa, (1, SCALE_BLOCK)) if sa_block else widen_fp8(x)
    w32 = dequantize_fp8(w, sb, (SCALE_BLOCK, SCALE_BLOCK)) if sb_block else widen_fp8(w)
    return x32, w32


def _reference(x, w, gs, sa, sb, *, sa_block, sb_block, out_dtype, config, local):
    """What the kernel computes, in XLA: the dequantised operands' ragged product in fp32 (w read
    as [G, K, N] through its K-major storage), the one-value scales, one rounding."""
    del config, local
    x32, w32 = dequantised(x, w, sa, sb, sa_block, sb_block)
    batch = x.shape[0]
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    one = functools.partial(lax.ragged_dot_general, ragged_dot_dimension_numbers=dims,
                            precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    # Sizes clamped to [0, M] as the kernel reads them (lax gives negative sizes no meaning).
    gs = clamp_sizes(gs, x.shape[1])
    # NOTE: lax batches ragged_dot only with every operand mapped.
    out = jax.vmap(one)(x32, jnp.broadcast_to(w32, (batch, *w32.shape[1:])),
                        jnp.broadcast_to(gs, (batch, gs.shape[1])))
    if not sa_block:
        out = out * sa
    if not sb_block:
        out = out * sb
    return out.astype(out_dtype)


def kernel_plan(x, w, gs, out_dtype) -> RaggedPlan | None:
    """The kernel's view of the product, or None when it runs through XLA: operands not both
    e4m3, an output not bf16 or fp32, an empty product, or sizes past the kernel's int32
    numbering."""
    dtype = jnp.dtype(x.dtype)
    if dtype not in KERNEL_DTYPES or jnp.dtype(w.dtype) != dtype:
        return None
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        return None
    batch, rows, k = x.shape
    groups, n = w.shape[1], w.shape[2]
    if min(batch, rows, k, n, groups) < 1:
        return None
    k_pad, n_pad = -k % _K_MULTIPLE, -n % _N_MULTIPLE
    np_ = n + n_pad
    stacked = batch * rows
    if (max(stacked, k + k_pad, np_) > _INT32_MAX or batch * groups > _INT32_MAX // 2
            or (stacked // 64 + batch * (groups + 1)) * -(-np_ // 128) > _INT32_MAX // 2):
        return None
    return RaggedPlan(ROWS, batch, rows, k, n, groups, k_pad, n_pad)


def _kernel_call(x, w, gs, sa, sb, *, plan: RaggedPlan, sa_block: bool, sb_block: bool,
                 out_dtype, config, poison: bool = False):
    """The FFI call for `plan`: K and N padded with zeros (neither changes the scales' block
    counts: the padding ends within the last block), the scales' rows padded to 16 bytes, sa's
    entries stacked like x's rows, group sizes as int32 clamped to [0, M]. With `poison` the
    kernel writes over a NaN-filled output (tests)."""
    out_dtype = jnp.dtype(out_dtype)
    f32 = jnp.float32
    kp, np_ = plan.k + plan.k_pad, plan.n + plan.n_pad
    kb, nb = _blocks(kp), _blocks(np_)
    x = _pad_axis(x, 2, plan.k_pad)
    w = _pad_axis(_pad_axis(w, 3, plan.k_pad), 2, plan.n_pad)
    weights = w.shape[0] * plan.groups
    w = w.reshape(weights, np_, kp)
    gs = clamp_sizes(gs, plan.rows)
    cfg = config if config is not None else default_ragged_config(
        plan.batch * plan.rows, np_, kp, plan.groups * plan.batch)
    placeholder = jnp.zeros((1,), f32)
    if sa_block:  # [B, Kb, M] -> [Kb, B x M], the stacked rows' scales
        sa = jnp.swapaxes(sa.astype(f32), 0, 1).reshape(kb, plan.batch * plan.rows)
        sa, row_scale = _pad_to(sa, 1, _SCALE_ROW_MULTIPLE), placeholder
    else:
        sa, row_scale = placeholder, sa.astype(f32).reshape(1)
    if sb_block:  # [Bw, G, Kb, Nb] -> [weights, Kb, Nb], Nb padded to 16 bytes
        sb = _pad_to(sb.astype(f32).reshape(weights, kb, nb), 2, _SCALE_ROW_MULTIPLE)
        col_scale = placeholder
    else:
        sb, col_scale = placeholder, sb.astype(f32).reshape(1)
    i64 = np.int64
    attrs = dict(
        call_attrs(cfg, plan, np_, kp, weights > plan.groups, gs),
        sa_ld=i64(sa.shape[1] if sa_block else _SCALE_ROW_MULTIPLE),
        sb_ld=i64(sb.shape[2] if sb_block else _SCALE_ROW_MULTIPLE), has_sa=i64(sa_block),
        has_sb=i64(sb_block), row_scale=i64(not sa_block), col_scale=i64(not sb_block))
    out_types = (jax.ShapeDtypeStruct((plan.batch, plan.rows, np_), out_dtype),
                 jax.ShapeDtypeStruct((workspace_bytes(ROWS, plan.groups, plan.batch),),
                                      jnp.uint8))
    out, _ = kernel_ffi_call(KERNEL_TARGET, out_types,
                             (x, w, gs, sa, sb, row_scale, col_scale), attrs, poison=poison)
    return out[..., :plan.n] if plan.n_pad else out


def _kernel_fn(avals_in, params):
    """The kernel call of one device's product, or None where the reference runs it."""
    if not kernel_enabled():
        return None
    return planned_call(_kernel_call, kernel_plan(*avals_in[:3], params["out_dtype"]), params)


def _partitioned(params):
    return functools.partial(ragged_sharding.partitioned_fp8_ragged_dot,
                             local_op=bind_local(fp8_ragged_dot_p), params=params)


def bind(x, w, gs, sa, sb, *, sa_block: bool, sb_block: bool, out_dtype, config=None,
         local: bool = False):
    """The primitive on x [B, M, K], w [Bw, G, N, K], group sizes [Bg, G] and the scales (see
    the module docstring)."""
    return fp8_ragged_dot_p.bind(x, w, gs, sa, sb, sa_block=bool(sa_block),
                                 sb_block=bool(sb_block), out_dtype=jnp.dtype(out_dtype),
                                 config=config, local=local)


def _batch_rule(args, dims, *, sa_block, sb_block, out_dtype, config, local):
    """vmap: the mapped axis joins the batch (x [V*B, M, K]), with x's block scales; the weights
    and their block scales join it together (one batchedness for both), or stay shared where
    neither is mapped; shared group sizes stay shared. A one-value scale that varies along the
    mapped axis becomes a block scale of that value (the kernel takes one value per call)."""
    del config
    x, w, gs, sa, sb = args
    dx, dw, dgs, dsa, dsb = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    unmapped = lambda v, d: v.shape if d is None else v.shape[:d] + v.shape[d + 1:]  # noqa: E731
    batch, rows, k = unmapped(x, dx)
    w_batch, groups, n, _ = unmapped(w, dw)
    if not sa_block and dsa is not None:
        s = jnp.moveaxis(sa, dsa, 0).reshape(size, 1, 1, 1)
        sa, dsa, sa_block = jnp.broadcast_to(s, (size, batch, _blocks(k), rows)), 0, True
    if not sb_block and dsb is not None:
        s = jnp.moveaxis(sb, dsb, 0).reshape(size, 1, 1, 1, 1)
        sb = jnp.broadcast_to(s, (size, w_batch, groups, _blocks(k), _blocks(n)))
        dsb, sb_block = 0, True
    w_shared = dw is None and (not sb_block or dsb is None)
    operands, operand_dims, shared_ok = [x, w, gs], [dx, dw, dgs], [False, w_shared, True]
    if sa_block:
        operands.append(sa)
        operand_dims.append(dsa)
        shared_ok.append(False)
    if sb_block:
        operands.append(sb)
        operand_dims.append(dsb)
        shared_ok.append(w_shared)
    folded, size, batch = fold_vmapped(operands, operand_dims, shared_ok)
    x, w, gs = folded[:3]
    rest = folded[3:]
    sa = rest.pop(0) if sa_block else sa
    sb = rest.pop(0) if sb_block else sb
    out = bind(x, w, gs, sa, sb, sa_block=sa_block, sb_block=sb_block, out_dtype=out_dtype,
               local=local)
    return out.reshape(size, batch, *out.shape[1:]), 0


def _jvp(primals, tangents, **params):
    del primals, tangents, params
    raise NotImplementedError(
        "jax_tma.fp8_ragged_dot: only first-order reverse-mode gradients (jax.grad, jax.vjp) "
        "are defined for the FP8 grouped product, not forward mode (jax.jvp, jax.jacfwd) nor "
        "gradients of its gradients")


fp8_ragged_dot_p = define_primitive("jax_tma_fp8_ragged_dot", abstract_eval=_abstract_eval,
                                    reference=_reference, kernel_fn=_kernel_fn,
                                    partitioned=_partitioned)
ad.primitive_jvps[fp8_ragged_dot_p] = _jvp
batching.primitive_batchers[fp8_ragged_dot_p] = _batch_rule
