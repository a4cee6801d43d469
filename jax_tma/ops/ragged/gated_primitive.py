"""The gated grouped primitive ``jax_tma_gated_ragged_dot`` behind ``jax_tma.gated_ragged_dot``
(gated.py): a batch (vmap adds to it) of ``act(x @ w_gate[g]) * (x @ w_up[g])`` over the rows of
each group, optionally with the gate's and the up's pre-activations as a second result (saved for
the backward pass). It lowers to XLA everywhere and, on CUDA, to the
``jax_tma_gated_ragged_dot_sm90`` kernel pair when the operands and the output are bf16 or fp16
of one type (csrc/contract/sm90_ragged_dot.h, the gated rows mode): both products in one
mainloop, the gated epilogue stores the [M, F] result once. Batching folds vmapped axes into the
kernel's batch; sharding is ragged_dot's rows form with K kept whole (sharding.py); its JVP
(second order only: the public function has its own) differentiates the reference.

Operands x [B, M, K], w_gate and w_up [Bw, G, K, F], group sizes [Bg, G] (Bw, Bg: 1 or B).
Results out [B, M, F], and with ``save_pre`` pre [2, B, M, F] (gate, up). Rows past the last
group are zero in every result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching

from jax_tma._core.aval import result_aval
from jax_tma._core.primitive import bind_local, define_primitive, kernel_ffi_call, planned_call
from jax_tma.ops.dense.primitive import ACTIVATIONS, activate
from jax_tma.ops.ragged import sharding as ragged_sharding
from jax_tma.ops.ragged.config import ROWS, clamp_sizes, default_gated_config
from jax_tma.ops.ragged.primitive import (_INT32_MAX, _pad_axis, call_attrs, fold_vmapped,
                                          kernel_plan, rows_product, rows_reference,
                                          workspace_bytes)

KERNEL_TARGET = "jax_tma_gated_ragged_dot_sm90"
# sm90_gemm::kRaggedGatedMapsPerSegment: D's map and the two pre-activations' per segment.
_MAPS_PER_SEGMENT = 3


def gated_workspace_bytes(groups: int, batch: int) -> int:
    """Bytes of the gated kernel's workspace (ragged_workspace_bytes, three maps a segment)."""
    return workspace_bytes(ROWS, groups, batch, _MAPS_PER_SEGMENT)


def _shapes(x, w):
    b, m, _ = x.shape
    return (b, m, w.shape[3]), (2, b, m, w.shape[3])


def _abstract_eval(x, wg, wu, gs, *, activation, save_pre, out_dtype, config, local):
    del activation, config, local
    out, pre = _shapes(x, wg)
    results = [result_aval(out, out_dtype, x, wg, wu, gs)]
    if save_pre:
        results.append(result_aval(pre, out_dtype, x, wg, wu, gs))
    return results


def _gated_results(gate, up, activation, save_pre, out_dtype):
    """The results from the fp32 products, rounded to ``out_dtype`` where the unfused
    expression rounds (each product, the activation, the product of the two), as gated_dense
    rounds."""

    def rounded(v):
        return v.astype(out_dtype).astype(jnp.float32)

    gate, up = rounded(gate), rounded(up)
    results = [(rounded(activate(activation, gate)) * up).astype(out_dtype)]
    if save_pre:
        results.append(jnp.stack([gate, up]).astype(out_dtype))
    return results


def _reference(x, wg, wu, gs, *, activation, save_pre, out_dtype, config, local):
    """What the kernel computes, in XLA: fp32 accumulation and arithmetic, rounded where the
    unfused expression rounds."""
    del config, local
    return _gated_results(rows_reference(x, wg, gs, jnp.float32),
                          rows_reference(x, wu, gs, jnp.float32), activation, save_pre,
                          out_dtype)


def _kernel_call(x, wg, wu, gs, *, activation, save_pre, out_dtype, config, plan,
                 poison: bool = False):
    """The FFI call: K and F padded with zeros to multiples of 8 where needed (padded output
    columns are act(0) * 0 = 0, cut off), group sizes as int32 clamped to [0, M]. With `poison`
    the kernel writes over NaN-filled results (tests)."""
    out_dtype = jnp.dtype(out_dtype)
    x = _pad_axis(x, 2, plan.k_pad)
    wg, wu = (_pad_axis(_pad_axis(w, 2, plan.k_pad), 3, plan.n_pad) for w in (wg, wu))
    kp, fp = plan.k + plan.k_pad, plan.n + plan.n_pad
    gs = clamp_sizes(gs, plan.rows)
    cfg = config if config is not None else default_gated_config(
        plan.batch * plan.rows, fp, kp, plan.groups * plan.batch)
    attrs = dict(call_attrs(cfg, plan, fp, kp, wg.shape[0] > 1, gs),
                 activation=np.int64(ACTIVATIONS[activation]), store_pre=np.int64(save_pre))
    pre_shape = (2, plan.batch, plan.rows, fp) if save_pre else (1,)
    out_types = (jax.ShapeDtypeStruct((plan.batch, plan.rows, fp), out_dtype),
                 jax.ShapeDtypeStruct(pre_shape, out_dtype),
                 jax.ShapeDtypeStruct((gated_workspace_bytes(plan.groups, plan.batch),),
                                      jnp.uint8))
    out, pre, _ = kernel_ffi_call(KERNEL_TARGET, out_types, (x, wg, wu, gs), attrs,
                                  poison=poison, poisoned=(0, 1))
    results = [out[..., :plan.n]]
    if save_pre:
        results.append(pre[..., :plan.n])
    return results


def gated_kernel_plan(x, wg, wu, gs, out_dtype):
    """The kernel's view of the call (ragged_dot's rows-form plan), or None when it runs
    through XLA: operands or output not of one 16-bit type, an empty product, or a schedule
    of gate and up columns past the kernel's int32 numbering."""
    dtype = jnp.dtype(x.dtype)
    if jnp.dtype(out_dtype) != dtype or any(jnp.dtype(w.dtype) != dtype for w in (wg, wu)):
        return None
    plan = kernel_plan(x, wg, gs, ROWS, False, out_dtype)
    if plan is None:
        return None
    acc_cols = 2 * (plan.n + plan.n_pad)
    if (plan.batch * plan.rows // 64 + plan.batch * (plan.groups + 1)) * -(-acc_cols // 128) \
            > _INT32_MAX // 2:
        return None
    return plan


def _kernel_fn(avals_in, params):
    return planned_call(_kernel_call, gated_kernel_plan(*avals_in, params["out_dtype"]), params)


def _partitioned(params):
    return functools.partial(ragged_sharding.partitioned_gated_ragged_dot,
                             local_op=bind_local(gated_ragged_dot_p), params=params)


def bind(x, wg, wu, gs, *, activation: str, save_pre: bool, out_dtype, config=None,
         local: bool = False):
    """The primitive on x [B, M, K], w_gate and w_up [Bw, G, K, F], group sizes [Bg, G]."""
    return gated_ragged_dot_p.bind(x, wg, wu, gs, activation=activation,
                                   save_pre=bool(save_pre), out_dtype=jnp.dtype(out_dtype),
                                   config=config, local=local)


def _batch_rule(args, dims, *, activation, save_pre, out_dtype, config, local):
    """vmap: the mapped axis joins the batch (x [V*B, M, K]); shared weights and group sizes
    stay shared."""
    del config
    folded, size, batch = fold_vmapped(args, dims, (False, True, True, True))
    outs = bind(*folded, activation=activation, save_pre=save_pre, out_dtype=out_dtype,
                local=local)
    results, result_dims = [outs[0].reshape(size, batch, *outs[0].shape[1:])], [0]
    if save_pre:  # [2, V*B, M, F]: the vmapped axis is dim 1
        results.append(outs[1].reshape(2, size, batch, *outs[1].shape[2:]))
        result_dims.append(1)
    return results, result_dims


def _jvp(primals, tangents, *, activation, save_pre, out_dtype, config, local):
    """The JVP of the results as the two products of ragged_dot's primitive compute them (whose
    rules transpose them to any order: second-order gradients of gated_ragged_dot differentiate
    the saved pre-activations; first-order ones never reach this rule)."""
    x, wg, wu, gs = primals
    tangents = [jnp.zeros_like(p) if type(t) is ad.Zero else t
                for p, t in zip(primals[:3], tangents[:3])]
    outs = gated_ragged_dot_p.bind(*primals, activation=activation, save_pre=save_pre,
                                   out_dtype=out_dtype, config=config, local=local)

    def composed(x, wg, wu):
        return _gated_results(rows_product(x, wg, gs, jnp.float32, local),
                              rows_product(x, wu, gs, jnp.float32, local), activation, save_pre,
                              out_dtype)

    _, tangent_outs = jax.jvp(composed, (x, wg, wu), tuple(tangents))
    return outs, tangent_outs


gated_ragged_dot_p = define_primitive("jax_tma_gated_ragged_dot", abstract_eval=_abstract_eval,
                                      reference=_reference, kernel_fn=_kernel_fn,
                                      partitioned=_partitioned, multiple_results=True)
ad.primitive_jvps[gated_ragged_dot_p] = _jvp
batching.primitive_batchers[gated_ragged_dot_p] = _batch_rule
