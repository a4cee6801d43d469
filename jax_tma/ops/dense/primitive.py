"""The fused-epilogue primitive ``jax_tma_dense`` behind ``jax_tma.dense``, ``gated_dense``,
``mlp`` and ``gated_mlp`` (api.py): one product of the sm90 GEMM kernel with the bias,
activation, residual or gating in its epilogue (csrc/epilogue/fusion.h), its XLA reference
(rounding where the unfused 16-bit expression rounds), vmap, a JVP through the reference (for
second-order gradients) and sharding through ``custom_partitioning`` (sharding.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, batching

from jax_tma._core import device
from jax_tma._core.aval import result_aval
from jax_tma._core.activations import GATED_ACTIVATIONS, activate  # noqa: F401 (re-exported)
from jax_tma._core.primitive import bind_local, define_primitive, kernel_ffi_call
from jax_tma.ops.dense import sharding as dense_sharding
from jax_tma.ops.dense.config import (_KIND, FORWARD, GATED, GATED_GRADIENT,
                                      GATED_GRADIENT_MIN_ROWS, GRADIENT, configs_for,
                                      default_config)
from jax_tma.ops.gemm.config import KERNEL_INPUT_DTYPES

KERNEL_TARGET = "jax_tma_dense_sm90"
ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2, "gelu_tanh": 2, "gelu_erf": 3, "silu": 4}
_STRIDE = 8  # k and n multiples of 8: 16-byte rows


def activation_grad(name: str | None, z):
    """d act / dz at z, elementwise in jnp (differentiable again: second-order gradients)."""
    if name is None:
        return jnp.ones_like(z)
    flat = z.reshape(-1)
    return jax.vmap(jax.grad(lambda v: activate(name, v)))(flat).reshape(z.shape)


def _activation_second(name: str, z):
    flat = z.reshape(-1)
    return jax.vmap(jax.grad(jax.grad(lambda v: activate(name, v))))(flat).reshape(z.shape)


# --------------------------------------------------------------------------------------
# The primitive: a = [M, K]; b = [K, N] (or [N, K] with b_k_major: the gradient reads w as
# stored); then b2 (gated), bias (fp32 [N]) and aux ([M, N]; gated gradient: the gate's and
# the up's pre-activations, [2, M, N]) where present. Results: out [M, N], and with save_pre
# the pre-activation(s): [M, N], gated [2, M, N]; the gated gradient's are the gate's and the
# up's cotangents, [M, N] each (always both).


def _shapes(a, b, *, kind, b_k_major, save_pre):
    """The results' shapes: (out, the second result's or None)."""
    m, _ = a.shape
    n = b.shape[0] if b_k_major else b.shape[1]
    out = (m, n)
    if kind == GATED_GRADIENT:
        return out, out
    if not save_pre:
        return out, None
    return out, ((2, m, n) if kind == GATED else (m, n))


def _abstract_eval(a, b, *rest, kind, activation, has_bias, has_aux, save_pre, b_k_major,
                   out_dtype, config, local):
    del activation, has_bias, has_aux, config, local
    out, pre = _shapes(a, b, kind=kind, b_k_major=b_k_major, save_pre=save_pre)
    results = [result_aval(out, out_dtype, a, b, *rest)]
    if pre is not None:
        results.append(result_aval(pre, out_dtype, a, b, *rest))
    return results


def _split_rest(rest, kind, has_bias, has_aux):
    rest = list(rest)
    b2 = rest.pop(0) if kind == GATED else None
    bias = rest.pop(0) if has_bias else None
    aux = rest.pop(0) if has_aux else None
    return b2, bias, aux


def _reference(a, b, *rest, kind, activation, has_bias, has_aux, save_pre, b_k_major, out_dtype,
               config, local):
    """What the kernel computes, in XLA: fp32 accumulation and arithmetic, rounded to
    ``out_dtype`` where the unfused expression rounds (forward and gated; the gradient's
    product and derivative once)."""
    del config, local
    b2, bias, aux = _split_rest(rest, kind, has_bias, has_aux)
    dims = (((1,), (1,)), ((), ())) if b_k_major else (((1,), (0,)), ((), ()))
    acc = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    def rounded(v):
        return v.astype(out_dtype).astype(jnp.float32)

    pre = []
    if kind == FORWARD:
        acc = rounded(acc)
        if bias is not None:
            acc = rounded(acc + bias.astype(jnp.float32))
        pre = [acc]
        out = activate(activation, acc)
        if aux is not None:
            out = rounded(out) + aux.astype(jnp.float32)
    elif kind == GRADIENT:
        out = acc * activation_grad(activation, aux.astype(jnp.float32))
    elif kind == GATED_GRADIENT:
        acc = rounded(acc)
        gate, up = aux[0].astype(jnp.float32), aux[1].astype(jnp.float32)
        out = acc * up * activation_grad(activation, gate)
        pre = [acc * activate(activation, gate)]
    else:
        acc = rounded(acc)
        up = rounded(lax.dot_general(a, b2, dims, preferred_element_type=jnp.float32))
        pre = [jnp.stack([acc, up])]
        out = rounded(activate(activation, acc)) * up
    results = [out.astype(out_dtype)]
    if save_pre or kind == GATED_GRADIENT:
        results.append(pre[0].astype(out_dtype))
    return results


# Bias types the epilogue reads as they are (widened to fp32 there); others are converted to fp32
# first.
_BIAS_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _bias_operand(bias):
    """A bias as the kernel reads it: fp32, bf16 and fp16 as they are, other types in fp32."""
    bias = jnp.asarray(bias)
    return bias if bias.dtype in _BIAS_DTYPES else bias.astype(jnp.float32)


def kernel_applies(a, b, rest, *, kind, activation, has_bias, has_aux, b_k_major,
                   out_dtype) -> bool:
    """Whether the fused kernel computes this call: operands of one 16-bit type (the output
    too), a bias of fp32, bf16 or fp16, k and n multiples of 8, sizes in the kernel's range, a
    compiled fusion; for the gated gradient, at least GATED_GRADIENT_MIN_ROWS rows."""
    b2, bias, aux = _split_rest(rest, kind, has_bias, has_aux)
    dtype = jnp.dtype(a.dtype)
    same = [x for x in (b, b2, aux) if x is not None]
    if (dtype not in KERNEL_INPUT_DTYPES or jnp.dtype(out_dtype) != dtype
            or any(jnp.dtype(x.dtype) != dtype for x in same)
            or (bias is not None and jnp.dtype(bias.dtype) not in _BIAS_DTYPES)):
        return False
    m, k = a.shape
    n = b.shape[0] if b_k_major else b.shape[1]
    if min(m, n, k) < 1 or k % _STRIDE or n % _STRIDE or max(m, 2 * n, k) >= 2**30:
        return False
    if kind == GATED_GRADIENT and m < GATED_GRADIENT_MIN_ROWS:
        return False
    return (kind != FORWARD or activation in ACTIVATIONS) and bool(configs_for(kind, activation))


def _kernel_call(a, b, *rest, kind, activation, has_bias, has_aux, save_pre, b_k_major,
                 out_dtype, config, poison=False):
    b2, bias, aux = _split_rest(rest, kind, has_bias, has_aux)
    m, k = a.shape
    n = b.shape[0] if b_k_major else b.shape[1]
    cfg = config if config is not None else default_config(kind, activation, m, n, k)
    dtype = jnp.dtype(out_dtype)
    placeholder = jnp.zeros((1,), dtype)
    out_shape, pre_shape = _shapes(a, b, kind=kind, b_k_major=b_k_major, save_pre=save_pre)
    workspace = cfg.stream_k_workspace_bytes(device.num_sms())
    out_types = (jax.ShapeDtypeStruct(out_shape, dtype),
                 jax.ShapeDtypeStruct(pre_shape or (1,), dtype),
                 jax.ShapeDtypeStruct((max(workspace, 1),), jnp.uint8))
    i64 = np.int64
    attrs = dict(kind=i64(_KIND[kind]), activation=i64(ACTIVATIONS[activation]),
                 has_bias=i64(has_bias), has_aux=i64(has_aux), store_pre=i64(save_pre),
                 b_k_major=i64(b_k_major), block_m=i64(cfg.block_m), block_n=i64(cfg.block_n),
                 stages=i64(cfg.stages), cluster_m=i64(cfg.cluster_m),
                 stream_k=i64(cfg.stream_k), m=i64(m), n=i64(n), k=i64(k))
    operands = (a, b, b2 if b2 is not None else placeholder,
                bias if bias is not None else jnp.zeros((1,), jnp.float32),
                aux if aux is not None else placeholder)
    out, pre, _ = kernel_ffi_call(KERNEL_TARGET, out_types, operands, attrs, poison=poison,
                                  poisoned=(0, 1))
    return [out, pre] if pre_shape is not None else [out]


def _kernel_fn(avals_in, params):
    """The fused kernel's call, or None where the reference runs (XLA)."""
    if not kernel_applies(avals_in[0], avals_in[1], avals_in[2:], kind=params["kind"],
                          activation=params["activation"], has_bias=params["has_bias"],
                          has_aux=params["has_aux"], b_k_major=params["b_k_major"],
                          out_dtype=params["out_dtype"]):
        return None
    return functools.partial(_kernel_call, **{k: v for k, v in params.items() if k != "local"})


def _partitioned(params):
    return functools.partial(dense_sharding.partitioned_dense, local_op=_bind_local,
                             reference=_reference, params=params)


def _batch_rule(args, dims, **params):
    """vmap: the mapped axes of a (and aux) fold into M when the weights are shared; mapped
    weights or biases run the reference (a batched XLA product and epilogue)."""
    a, b, *rest = args
    b2, bias, aux = _split_rest(rest, params["kind"], params["has_bias"], params["has_aux"])
    weights_mapped = any(d is not None for d in dims[1:2]) or (
        params["kind"] == GATED and dims[2] is not None) or (
        bias is not None and dims[2 + (params["kind"] == GATED)] is not None)
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    if weights_mapped:
        moved = [jnp.moveaxis(x, d, 0) if d is not None else
                 jnp.broadcast_to(x, (size, *x.shape)) for x, d in zip(args, dims)]
        outs = jax.vmap(functools.partial(_reference, **params))(*moved)
        return outs, [0] * len(outs)
    a = jnp.moveaxis(a, dims[0], 0) if dims[0] is not None else jnp.broadcast_to(
        a, (size, *a.shape))
    m = a.shape[1]
    flat = [a.reshape(size * m, -1), b, *rest]
    if aux is not None:
        i = len(flat) - 1
        aux_dim = dims[len(args) - 1]
        aux = jnp.moveaxis(aux, aux_dim, 0) if aux_dim is not None else jnp.broadcast_to(
            aux, (size, *aux.shape))
        if params["kind"] == GATED_GRADIENT:  # [size, 2, m, n] -> [2, size * m, n]
            flat[i] = jnp.moveaxis(aux, 0, 1).reshape(2, size * m, -1)
        else:
            flat[i] = aux.reshape(size * m, -1)
    outs = dense_p.bind(*flat, **params)
    result, result_dims = [outs[0].reshape(size, m, -1)], [0]
    if len(outs) > 1:
        if params["kind"] == GATED:  # [2, size * m, n]: the batch is dim 1
            result.append(outs[1].reshape(2, size, m, -1))
            result_dims.append(1)
        else:
            result.append(outs[1].reshape(size, m, -1))
            result_dims.append(0)
    return result, result_dims


def _jvp(primals, tangents, **params):
    """The primitive's JVP through the XLA reference (second-order gradients of the public ops
    differentiate the saved pre-activation; first-order ones never reach this rule)."""
    tangents = [jnp.zeros_like(p) if type(t) is ad.Zero else t for p, t in zip(primals, tangents)]
    ref = functools.partial(_reference, **params)
    outs = dense_p.bind(*primals, **params)
    _, tangent_outs = jax.jvp(ref, tuple(primals), tuple(tangents))
    return outs, tangent_outs


dense_p = define_primitive("jax_tma_dense", abstract_eval=_abstract_eval, reference=_reference,
                           kernel_fn=_kernel_fn, partitioned=_partitioned,
                           multiple_results=True)
_bind_local = bind_local(dense_p)
ad.primitive_jvps[dense_p] = _jvp
batching.primitive_batchers[dense_p] = _batch_rule


def _bind(a, b, *rest, kind, activation=None, has_bias=False, has_aux=False, save_pre=False,
          b_k_major=False, out_dtype, config=None):
    return dense_p.bind(a, b, *rest, kind=kind, activation=activation, has_bias=bool(has_bias),
                        has_aux=bool(has_aux), save_pre=bool(save_pre),
                        b_k_major=bool(b_k_major), out_dtype=jnp.dtype(out_dtype),
                        config=config, local=False)
