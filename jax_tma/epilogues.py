"""Dense layers with fused epilogues: ``jax_tma.dense``, ``jax_tma.gated_dense``,
``jax_tma.mlp`` and the primitive behind them.

  dense(x, w, bias, activation, residual)   act(x @ w + bias) + residual
  gated_dense(x, w_gate, w_up, activation)  act(x @ w_gate) * (x @ w_up)
  mlp(x, w1, b1, w2, b2, activation, residual)
                                            act(x @ w1 + b1) @ w2 + b2 + residual
  gated_mlp(x, w_gate, w_up, w_down, activation, residual)
                                            (act(x @ w_gate) * (x @ w_up)) @ w_down + residual

On Hopper, bf16 or fp16 operands of one type run the sm90 GEMM kernel with the elementwise work
in its epilogue (csrc/epilogue/fusion.h), rounding to the output type (the operands' type) where
the unfused 16-bit expression ``act(x @ w + b) + r`` rounds: after the product, after the bias,
after the activation and after the sum (gated: ``act(x @ wg)``, ``x @ wu`` and their product),
each operation itself in fp32. So the forward output is the activation of the saved
pre-activation, and the results differ from the unfused expression only by the activation's
fp32 arithmetic (SFU approximations of exp and the reciprocal). The tanh GELU is computed as
``z * sigmoid(2u)``, equal to ``0.5 z (1 + tanh(u))`` but free of its cancellation for z < -3,
where ``jax.nn.gelu``'s fp32 form loses its low bits (and, below z = -5, all of them); the
kernel's values there are within a bf16 rounding of the exact ones. On 128-row tiles the
consumer warps round the product into shared memory and three otherwise idle warps of the
producer warpgroup apply the rest while the next tile's product runs
(csrc/epilogue/epilogue_warps.cuh). The XLA path of these functions (other dtypes, other
devices) rounds at the same places.

Gradients (``jax.custom_vjp``): the forward pass also stores the pre-activation when
differentiated (a second output of the same kernel); the backward pass multiplies by the
activation's derivative, then runs the products of ``jax_tma.dot_general``, and reduces the bias
gradient with one XLA reduction. ``mlp`` fuses across its two layers: the product
``dy @ w2^T`` applies the hidden activation's derivative in its epilogue (the saved
pre-activation read by TMA), so the hidden gradient never round-trips through memory unscaled;
``gated_mlp`` likewise: the product ``dy @ w_down^T`` writes the gate's and the up's cotangents
from its epilogue (both saved pre-activations read by TMA). Backward functions are
differentiable again (second order).

Activations: None, "relu", "gelu" (tanh approximation, ``jax.nn.gelu``'s default), "gelu_tanh",
"gelu_erf" (exact), "silu". Gated: "silu" (SwiGLU), "gelu", "gelu_tanh", "gelu_erf" (GeGLU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lax.lax import canonicalize_precision
from jax.interpreters import ad, batching

from jax_tma import _ext, epilogues_sharding
from jax_tma._core import aval as _aval
from jax_tma._core import device
from jax_tma._core.primitive import bind_local, define_primitive, kernel_ffi_call
from jax_tma._core.aval import result_aval
from jax_tma.gemm import dot_general as _dot_general
from jax_tma.gemm import kernel_precision
from jax_tma.gemm_config import KERNEL_INPUT_DTYPES, GemmConfig, as_config, estimate_seconds

KERNEL_TARGET = "jax_tma_dense_sm90"
# Fusion kinds and activations of csrc/epilogue/fusion.h.
FORWARD, GRADIENT, GATED = "forward", "gradient", "gated"
GATED_GRADIENT = "gated_gradient"
_KIND = {FORWARD: 1, GRADIENT: 2, GATED: 3, GATED_GRADIENT: 5}
ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2, "gelu_tanh": 2, "gelu_erf": 3, "silu": 4}
GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "gelu_erf")
# (block_m, block_n, stages, cluster_m) of JAX_TMA_SM90_DENSE_TILES; the forward gelu with erf
# is compiled on JAX_TMA_SM90_DENSE_NARROW_TILES only (csrc/kernels/sm90_dense.h).
_DENSE_TILES = ((128, 256, 3, 2), (128, 256, 3, 1), (128, 128, 6, 1), (64, 128, 8, 1))
_NARROW_TILES = ((128, 128, 6, 1), (64, 128, 8, 1))
# The gated gradient: JAX_TMA_SM90_DENSE_RING_TILES (the epilogue warps' ring holds its two
# pre-activations).
_RING_TILES = ((128, 256, 3, 2), (128, 256, 3, 1))
# Fewer rows leave the gated gradient to XLA (its dot, then one fusion): with a few 128 x 256
# tiles per SM the epilogue warps' pass is not hidden (H100, N x K = 14336 x 4096, bench_epilogues
# swiglu_grad, fused against XLA's form: M = 16 55.5 against 46.2 us, 64 59.8 / 54.8, 128
# 71.8 / 52.5, 256 76.0 / 63.1, 512 113.7 / 116.5).
GATED_GRADIENT_MIN_ROWS = 512
DENSE_CONFIGS: tuple[GemmConfig, ...] = tuple(GemmConfig(*t) for t in _DENSE_TILES)
_STRIDE = 8  # k and n multiples of 8: 16-byte rows


def _canonical(activation, allowed, what: str) -> str | None:
    if activation not in allowed:
        raise ValueError(f"jax_tma.{what}: activation must be one of "
                         f"{sorted(map(str, allowed))}, got {activation!r}")
    return "gelu_tanh" if activation == "gelu" else activation


def activate(name: str | None, z):
    """The activation in fp32 jnp (the XLA path, and the reference of the kernel's)."""
    if name is None:
        return z
    if name == "relu":
        return jnp.maximum(z, 0)
    if name == "gelu_tanh":
        return jax.nn.gelu(z, approximate=True)
    if name == "gelu_erf":
        return jax.nn.gelu(z, approximate=False)
    if name == "silu":
        return jax.nn.silu(z)
    raise ValueError(name)


def activation_grad(name: str | None, z):
    """d act / dz at z, elementwise in jnp (differentiable again: second-order gradients)."""
    if name is None:
        return jnp.ones_like(z)
    flat = z.reshape(-1)
    return jax.vmap(jax.grad(lambda v: activate(name, v)))(flat).reshape(z.shape)


def _activation_second(name: str, z):
    flat = z.reshape(-1)
    return jax.vmap(jax.grad(jax.grad(lambda v: activate(name, v))))(flat).reshape(z.shape)


def _configs_for(kind: str, activation: str | None) -> tuple[GemmConfig, ...]:
    if kind == GATED_GRADIENT:  # not with the exact GELU (its erff spilled there): XLA's
        return () if activation == "gelu_erf" else tuple(
            c for c in DENSE_CONFIGS if c.tile in _RING_TILES)
    narrow_only = kind == FORWARD and activation == "gelu_erf"
    return tuple(c for c in DENSE_CONFIGS if not narrow_only or c.tile in _NARROW_TILES)


def default_config(kind: str, activation, m: int, n: int, k: int,
                   num_sms: int | None = None) -> GemmConfig:
    """The compiled fused tile with the least estimated time (the dense GEMM's cost model,
    gemm_config.estimate_seconds; a gated product is 2n accumulator columns wide)."""
    num_sms = device.num_sms() if num_sms is None else num_sms
    acc_n = 2 * n if kind == GATED else n
    best, best_key = None, None
    for cfg in _configs_for(kind, activation):
        for stream_k in (False, True) if cfg.takes_stream_k else (False,):
            if stream_k and m < cfg.block_m:
                continue
            c = dataclasses.replace(cfg, stream_k=stream_k)
            seconds = estimate_seconds(c, m, acc_n, k, num_sms,
                                       dram_bytes_per_s=device.dram_bytes_per_s(),
                                       l2_bytes=device.l2_bytes())
            key = (round(seconds, 9), -c.stages, -c.cluster_m, int(stream_k))
            if best_key is None or key < best_key:
                best, best_key = c, key
    return best


_OP_OF_KIND = {FORWARD: "dense", GRADIENT: "dense", GATED: "gated_dense",
               GATED_GRADIENT: "gated_mlp"}


def _check_config(config: GemmConfig, kind: str, activation) -> GemmConfig:
    config = as_config(config, f"jax_tma.{_OP_OF_KIND[kind]}")
    tiles = {c.tile for c in _configs_for(kind, activation)}
    if config.tile not in tiles or config.split_k != 1:
        choices = "; ".join(c.describe() for c in _configs_for(kind, activation))
        raise ValueError(f"jax_tma.{_OP_OF_KIND[kind]}: GemmConfig({config.describe()}) is not "
                         f"compiled for the "
                         f"{kind} fusion with activation {activation!r}; choose one of: {choices}")
    return config


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
    return (kind != FORWARD or activation in ACTIVATIONS) and bool(_configs_for(kind, activation))


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
    return functools.partial(epilogues_sharding.partitioned_dense, local_op=_bind_local,
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


# --------------------------------------------------------------------------------------
# Public ops and their gradients.

_MATMUL = (((1,), (0,)), ((), ()))


def _as_2d(x):
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


def _is_zero(t) -> bool:
    return isinstance(t, jax.custom_derivatives.SymbolicZero)


def _add(a, b):
    return b if a is None else a + b


def _linear_terms(x, w, dx, dw, dims=_MATMUL):
    """dx @ w + x @ dw (the tangent of the product) as fp32, None when both are zero. The
    products keep the operands' type, so their transposes (the backward pass) are kernels too:
    the cotangent reaches them rounded to that type, as the pre-activation's does in the
    unfused expression."""
    t = None
    if not _is_zero(dx):
        t = _add(t, _dot_general(dx, w, dims).astype(jnp.float32))
    if not _is_zero(dw):
        t = _add(t, _dot_general(x, dw, dims).astype(jnp.float32))
    return t


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6, 7))
def _dense(x, w, bias, residual, has_bias, has_residual, activation, config):
    out, = _bind(x, w, *([bias] if has_bias else []), *([residual] if has_residual else []),
                 kind=FORWARD, activation=activation, has_bias=has_bias, has_aux=has_residual,
                 out_dtype=x.dtype, config=config)
    return out


def _dense_jvp(has_bias, has_residual, activation, config, primals, tangents):
    x, w, bias, residual = primals
    dx, dw, db, dr = tangents
    save = activation is not None
    outs = _bind(x, w, *([bias] if has_bias else []), *([residual] if has_residual else []),
                 kind=FORWARD, activation=activation, has_bias=has_bias, has_aux=has_residual,
                 save_pre=save, out_dtype=x.dtype, config=config)
    y = outs[0]
    t = _linear_terms(x, w, dx, dw)
    if has_bias and not _is_zero(db):
        t = _add(t, jnp.broadcast_to(db.astype(jnp.float32), y.shape))
    if t is not None and save:  # the pre-activation from the same kernel
        t = t * activation_grad(activation, outs[1].astype(jnp.float32))
    if has_residual and not _is_zero(dr):
        t = _add(t, dr.astype(jnp.float32))
    return y, (jnp.zeros_like(y) if t is None else t.astype(y.dtype))


_dense.defjvp(_dense_jvp, symbolic_zeros=True)


def _prepare(name: str, x, weights: dict, extras: dict, activation):
    """Checks shapes and dtypes like the unfused expression; returns the common dtype."""
    x = jnp.asarray(x)
    for key, w in weights.items():
        if jnp.ndim(w) != 2 or jnp.shape(w)[0] != x.shape[-1]:
            raise ValueError(f"jax_tma.{name}: {key} must be [K, N] with K = x.shape[-1] = "
                             f"{x.shape[-1]}, got shape {jnp.shape(w)}")
    dtype = jnp.result_type(x, *weights.values(), *(v for v in extras.values() if v is not None))
    return dtype


def _kernel_computes(precision, preferred_element_type, dtype) -> bool:
    """Whether the fused kernels' route computes the product as `precision` and
    `preferred_element_type` ask (lax's keywords): an output of the operands' type, and a
    precision the 16-bit kernel computes (gemm.kernel_precision); for other operand types only
    the default precision, which the route's XLA form uses. Anything else runs _unfused."""
    dtype = jnp.dtype(dtype)
    if preferred_element_type is not None and jnp.dtype(preferred_element_type) != dtype:
        return False
    if precision is None:
        return True
    return dtype in KERNEL_INPUT_DTYPES and kernel_precision(canonicalize_precision(precision),
                                                             dtype)


def _unfused(x, w, precision, preferred_element_type):
    """``x @ w`` as lax computes it with these keywords: the product of the XLA route taken
    where _kernel_computes is False (autodiff, vmap and sharding are lax's)."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=preferred_element_type)


def dense(x: Any, w: Any, bias: Any = None, activation: str | None = None,
          residual: Any = None, *, precision=None, preferred_element_type=None,
          config: GemmConfig | None = None) -> jax.Array:
    """``act(x @ w + bias) + residual`` with the bias, activation and residual in the epilogue.

    Args:
      x: [..., K]. w: [K, N]. bias: [N] (any float type; added in fp32: fp32, bf16 and fp16 are
        read by the epilogue as they are, other types converted first) or None.
      activation: None, "relu", "gelu" (tanh approximation), "gelu_tanh", "gelu_erf", "silu".
      residual: [..., N] like the result, or None.
      precision, preferred_element_type: as for ``lax.dot_general``, for the product. An
        output type other than the operands' or a precision the kernel does not compute
        (``_kernel_computes``) runs the unfused expression through XLA.
      config: a ``GemmConfig`` among ``DENSE_CONFIGS`` for the forward product.

    Returns:
      [..., N] in the promoted type of x, w, bias and residual (of the product's
      preferred_element_type, bias and residual when one is given). bf16/fp16 run the fused kernel
      (fp32 arithmetic, rounded where the unfused expression rounds); other types compute the
      same in XLA.
    """
    activation = _canonical(activation, ACTIVATIONS, "dense")
    dtype = _prepare("dense", x, {"w": w}, {"bias": bias, "residual": residual}, activation)
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    n = w.shape[1]
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (n,):
            raise ValueError(f"jax_tma.dense: bias must be [N] = [{n}], got {bias.shape}")
        bias = _bias_operand(bias)
    x2, lead = _as_2d(x)
    if residual is not None:
        residual = jnp.asarray(residual, dtype)
        if residual.shape != (*lead, n):
            raise ValueError(f"jax_tma.dense: residual must have the result's shape "
                             f"{(*lead, n)}, got {residual.shape}")
        residual = residual.reshape(-1, n)
    if not _kernel_computes(precision, preferred_element_type, dtype):
        z = _unfused(x2, w, precision, preferred_element_type)
        z = activate(activation, z if bias is None else z + bias)
        out = z if residual is None else z + residual
        return out.reshape(*lead, n)
    if config is not None:
        config = _check_config(config, FORWARD, activation)
    _ext.warn_if_unavailable()
    placeholder = jnp.zeros((), dtype)
    out = _dense(x2, w, placeholder if bias is None else bias,
                 placeholder if residual is None else residual, bias is not None,
                 residual is not None, activation, config)
    return out.reshape(*lead, n)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _gated(x, wg, wu, activation, config):
    out, = _bind(x, wg, wu, kind=GATED, activation=activation, out_dtype=x.dtype,
                 config=config)
    return out


def _gated_jvp(activation, config, primals, tangents):
    x, wg, wu = primals
    dx, dwg, dwu = tangents
    out, pre = _bind(x, wg, wu, kind=GATED, activation=activation, save_pre=True,
                     out_dtype=x.dtype, config=config)
    g, u = pre[0].astype(jnp.float32), pre[1].astype(jnp.float32)
    dg, du = _linear_terms(x, wg, dx, dwg), _linear_terms(x, wu, dx, dwu)
    t = None
    if dg is not None:
        t = _add(t, dg * activation_grad(activation, g) * u)
    if du is not None:
        t = _add(t, du * activate(activation, g))
    return out, (jnp.zeros_like(out) if t is None else t.astype(out.dtype))


_gated.defjvp(_gated_jvp, symbolic_zeros=True)


def gated_dense(x: Any, w_gate: Any, w_up: Any, activation: str = "silu", *, precision=None,
                preferred_element_type=None, config: GemmConfig | None = None) -> jax.Array:
    """``act(x @ w_gate) * (x @ w_up)`` (SwiGLU with "silu", GeGLU with "gelu") in one kernel:
    the gate and up columns of the same outputs are computed by one CTA and combined in its
    epilogue, so neither product is written to memory.

    Args:
      x: [..., K]. w_gate, w_up: [K, N]. activation: "silu", "gelu", "gelu_tanh", "gelu_erf".
      precision, preferred_element_type: as for ``dense``.
      config: a ``GemmConfig`` among ``DENSE_CONFIGS`` (its block_n counts gate and up columns).

    Returns:
      [..., N] in the promoted type; bf16/fp16 run the kernel (fp32 arithmetic, rounded where
      the unfused expression rounds).
    """
    activation = _canonical(activation, GATED_ACTIVATIONS, "gated_dense")
    dtype = _prepare("gated_dense", x, {"w_gate": w_gate, "w_up": w_up}, {}, activation)
    if jnp.shape(w_gate) != jnp.shape(w_up):
        raise ValueError(f"jax_tma.gated_dense: w_gate and w_up must have one shape, got "
                         f"{jnp.shape(w_gate)} and {jnp.shape(w_up)}")
    x, wg, wu = (jnp.asarray(v, dtype) for v in (x, w_gate, w_up))
    x2, lead = _as_2d(x)
    if not _kernel_computes(precision, preferred_element_type, dtype):
        gate = _unfused(x2, wg, precision, preferred_element_type)
        up = _unfused(x2, wu, precision, preferred_element_type)
        return (activate(activation, gate) * up).reshape(*lead, wg.shape[1])
    if config is not None:
        config = _check_config(config, GATED, activation)
    _ext.warn_if_unavailable()
    return _gated(x2, wg, wu, activation, config).reshape(*lead, wg.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _act_grad_product(g, w, z, activation):
    """(g @ w^T) * act'(z), act' applied in the product's epilogue (w [K, N], g [M, N], z
    [M, K]: the cotangent of a layer's input pre-activation z)."""
    out, = _bind(g, w, z, kind=GRADIENT, activation=activation, has_aux=True, b_k_major=True,
                 out_dtype=g.dtype)
    return out


def _agp_fwd(g, w, z, activation):
    return _act_grad_product(g, w, z, activation), (g, w, z)


def _agp_bwd(activation, saved, ct):
    g, w, z = saved
    z32 = z.astype(jnp.float32)
    t = (ct.astype(jnp.float32) * activation_grad(activation, z32)).astype(ct.dtype)
    dg = _dot_general(t, w, _MATMUL)
    dw = _dot_general(t, g, (((0,), (0,)), ((), ())))
    gw = _dot_general(g, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    dz = (ct.astype(jnp.float32) * gw * _activation_second(activation, z32)).astype(z.dtype)
    return tuple(_aval.sum_to_varying(c, p) for c, p in zip((dg, dw, dz), saved))


_act_grad_product.defvjp(_agp_fwd, _agp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _mlp(x, w1, b1, w2, b2, residual, activation, config):
    return _mlp_fwd(x, w1, b1, w2, b2, residual, activation, config)[0]


def _mlp_fwd(x, w1, b1, w2, b2, residual, activation, config):
    save = activation is not None
    first = _bind(x, w1, *([b1] if b1 is not None else []), kind=FORWARD, activation=activation,
                  has_bias=b1 is not None, save_pre=save, out_dtype=x.dtype, config=config)
    h, z = (first[0], first[1]) if save else (first[0], None)
    y, = _bind(h, w2, *([b2] if b2 is not None else []),
               *([residual] if residual is not None else []), kind=FORWARD,
               has_bias=b2 is not None, has_aux=residual is not None, out_dtype=x.dtype)
    # Empty slices of the optional operands: how each varies inside shard_map, for the
    # backward pass's cotangents (None where absent).
    probes = tuple(None if v is None else v.reshape(-1)[:0] for v in (b1, b2, residual))
    return y, (x, w1, w2, h, z, probes)


def _mlp_bwd(activation, config, saved, dy):
    del config
    x, w1, w2, h, z, (b1, b2, residual) = saved
    has_b1, has_b2, has_residual = b1 is not None, b2 is not None, residual is not None
    tn = (((0,), (0,)), ((), ()))
    # The hidden pre-activation's cotangent straight from the product's epilogue.
    dz = (_act_grad_product(dy, w2, z, activation) if activation is not None
          else _dot_general(dy, w2, (((1,), (1,)), ((), ()))))
    dw2 = _dot_general(h, dy, tn)
    dx = _dot_general(dz, w1, (((1,), (1,)), ((), ())))
    dw1 = _dot_general(x, dz, tn)
    db1 = jnp.sum(dz, axis=0, dtype=jnp.float32).astype(b1.dtype) if has_b1 else None
    db2 = jnp.sum(dy, axis=0, dtype=jnp.float32).astype(b2.dtype) if has_b2 else None
    cts = (dx, dw1, db1, dw2, db2, dy if has_residual else None)
    return tuple(None if c is None else _aval.sum_to_varying(c, p)
                 for c, p in zip(cts, (x, w1, b1, w2, b2, residual)))


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def mlp(x: Any, w1: Any, b1: Any, w2: Any, b2: Any, activation: str | None = "gelu",
        residual: Any = None, *, precision=None, preferred_element_type=None,
        config: GemmConfig | None = None) -> jax.Array:
    """``act(x @ w1 + b1) @ w2 + b2 + residual``: a transformer MLP block's two layers.

    Two fused kernels forward (bias and activation in the first's epilogue, which also saves
    the pre-activation when differentiated; bias and residual in the second's); backward, the
    product dy @ w2^T multiplies by act'(pre-activation) in its epilogue, then three more
    products and two bias reductions.

    Args:
      x: [..., D]. w1: [D, F]. b1: [F] or None. w2: [F, D']. b2: [D'] or None.
      activation: as for ``dense``. residual: [..., D'] or None.
      precision, preferred_element_type: as for ``dense``, for both products.
      config: the first (bias and activation) forward kernel's ``GemmConfig``, as for
        ``dense``; the other products are configured by the heuristic.
    """
    activation = _canonical(activation, ACTIVATIONS, "mlp")
    dtype = _prepare("mlp", x, {"w1": w1}, {"b1": b1, "residual": residual}, activation)
    x, w1, w2 = (jnp.asarray(v, dtype) for v in (x, w1, w2))
    if jnp.ndim(w2) != 2 or w2.shape[0] != w1.shape[1]:
        raise ValueError(f"jax_tma.mlp: w2 must be [F, D'] with F = w1.shape[1] = {w1.shape[1]}, "
                         f"got shape {w2.shape}")
    b1 = None if b1 is None else _bias_operand(b1)
    b2 = None if b2 is None else _bias_operand(b2)
    x2, lead = _as_2d(x)
    if residual is not None:
        residual = jnp.asarray(residual, dtype).reshape(-1, w2.shape[1])
    if not _kernel_computes(precision, preferred_element_type, dtype):
        z = _unfused(x2, w1, precision, preferred_element_type)
        h = activate(activation, z if b1 is None else z + b1)
        y = _unfused(h, w2, precision, preferred_element_type)
        y = y if b2 is None else y + b2
        y = y if residual is None else y + residual
        return y.reshape(*lead, w2.shape[1])
    if config is not None:
        config = _check_config(config, FORWARD, activation)
    _ext.warn_if_unavailable()
    return _mlp(x2, w1, b1, w2, b2, residual, activation, config).reshape(*lead, w2.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gated_grad_product(g, w, pre, activation, config):
    """The gate's and the up's cotangents of ``act(gate) * up`` from the down projection's:
    with h = g @ w^T (g [M, N] the output's cotangent, w [K, N] the down weights, pre [2, M, K]
    the saved gate and up pre-activations), (h * up * act'(gate), h * act(gate)), both from
    the product's epilogue."""
    dg, du = _bind(g, w, pre, kind=GATED_GRADIENT, activation=activation, has_aux=True,
                   b_k_major=True, out_dtype=g.dtype, config=config)
    return dg, du


def _ggp_fwd(g, w, pre, activation, config):
    return _gated_grad_product(g, w, pre, activation, config), (g, w, pre)


def _ggp_bwd(activation, config, saved, cts):
    del config
    g, w, pre = saved
    c_gate, c_up = (c.astype(jnp.float32) for c in cts)
    gate, up = pre[0].astype(jnp.float32), pre[1].astype(jnp.float32)
    slope = activation_grad(activation, gate)
    # The outputs are h * up * act'(gate) and h * act(gate), h = g @ w^T.
    c_h = (c_gate * up * slope + c_up * activate(activation, gate)).astype(g.dtype)
    dg = _dot_general(c_h, w, _MATMUL)
    dw = _dot_general(c_h, g, (((0,), (0,)), ((), ())))
    h = _dot_general(g, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    d_gate = h * (c_gate * up * _activation_second(activation, gate) + c_up * slope)
    d_up = h * c_gate * slope
    dpre = jnp.stack([d_gate, d_up]).astype(pre.dtype)
    return tuple(_aval.sum_to_varying(c, p) for c, p in zip((dg, dw, dpre), saved))


_gated_grad_product.defvjp(_ggp_fwd, _ggp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gated_mlp(x, wg, wu, wd, residual, activation, config):
    return _gated_mlp_fwd(x, wg, wu, wd, residual, activation, config)[0]


def _gated_mlp_fwd(x, wg, wu, wd, residual, activation, config):
    h, pre = _bind(x, wg, wu, kind=GATED, activation=activation, save_pre=True,
                   out_dtype=x.dtype, config=config)
    y, = _bind(h, wd, *([residual] if residual is not None else []), kind=FORWARD,
               has_aux=residual is not None, out_dtype=x.dtype)
    probe = None if residual is None else residual.reshape(-1)[:0]
    return y, (x, wg, wu, wd, h, pre, probe)


def _gated_mlp_bwd(activation, config, saved, dy):
    del config
    x, wg, wu, wd, h, pre, residual = saved
    tn, nt = (((0,), (0,)), ((), ())), (((1,), (1,)), ((), ()))
    # The gate's and the up's cotangents straight from the product's epilogue.
    d_gate, d_up = _gated_grad_product(dy, wd, pre, activation, None)
    dwd = _dot_general(h, dy, tn)
    dx = _dot_general(d_gate, wg, nt) + _dot_general(d_up, wu, nt)
    dwg = _dot_general(x, d_gate, tn)
    dwu = _dot_general(x, d_up, tn)
    cts = (dx, dwg, dwu, dwd, dy if residual is not None else None)
    return tuple(None if c is None else _aval.sum_to_varying(c, p)
                 for c, p in zip(cts, (x, wg, wu, wd, residual)))


_gated_mlp.defvjp(_gated_mlp_fwd, _gated_mlp_bwd)


def gated_mlp(x: Any, w_gate: Any, w_up: Any, w_down: Any, activation: str = "silu",
              residual: Any = None, *, precision=None, preferred_element_type=None,
              config: GemmConfig | None = None) -> jax.Array:
    """``(act(x @ w_gate) * (x @ w_up)) @ w_down + residual``: a SwiGLU ("silu") or GeGLU
    ("gelu") transformer MLP block.

    Forward: ``gated_dense``'s kernel (which also saves the gate and up pre-activations when
    differentiated), then the down projection with the residual in its epilogue. Backward: the
    product ``dy @ w_down^T`` writes the gate's and the up's cotangents from its epilogue
    (``dy @ w_down^T * up * act'(gate)`` and ``dy @ w_down^T * act(gate)``, fp32, each rounded
    once), so neither that product nor the cotangents make an extra pass over memory; then the
    five weight and input products.

    Args:
      x: [..., D]. w_gate, w_up: [D, F]. w_down: [F, D']. activation: "silu", "gelu",
      "gelu_tanh", "gelu_erf". residual: [..., D'] or None.
      precision, preferred_element_type: as for ``dense``, for every product.
      config: the gated forward kernel's ``GemmConfig`` (as for ``gated_dense``).
    """
    activation = _canonical(activation, GATED_ACTIVATIONS, "gated_mlp")
    dtype = _prepare("gated_mlp", x, {"w_gate": w_gate, "w_up": w_up}, {"residual": residual},
                     activation)
    if jnp.shape(w_gate) != jnp.shape(w_up):
        raise ValueError(f"jax_tma.gated_mlp: w_gate and w_up must have one shape, got "
                         f"{jnp.shape(w_gate)} and {jnp.shape(w_up)}")
    if jnp.ndim(w_down) != 2 or jnp.shape(w_down)[0] != jnp.shape(w_gate)[1]:
        raise ValueError(f"jax_tma.gated_mlp: w_down must be [F, D'] with F = w_gate.shape[1] = "
                         f"{jnp.shape(w_gate)[1]}, got shape {jnp.shape(w_down)}")
    x, wg, wu, wd = (jnp.asarray(v, dtype) for v in (x, w_gate, w_up, w_down))
    x2, lead = _as_2d(x)
    n_out = wd.shape[1]
    if residual is not None:
        if jnp.shape(residual) != (*lead, n_out):
            raise ValueError(f"jax_tma.gated_mlp: residual must have shape {(*lead, n_out)}, "
                             f"got {jnp.shape(residual)}")
        residual = jnp.asarray(residual, dtype).reshape(-1, n_out)
    if not _kernel_computes(precision, preferred_element_type, dtype):
        h = (activate(activation, _unfused(x2, wg, precision, preferred_element_type))
             * _unfused(x2, wu, precision, preferred_element_type))
        y = _unfused(h, wd, precision, preferred_element_type)
        y = y if residual is None else y + residual
        return y.reshape(*lead, n_out)
    if config is not None:
        config = _check_config(config, GATED, activation)
    _ext.warn_if_unavailable()
    return _gated_mlp(x2, wg, wu, wd, residual, activation, config).reshape(*lead, n_out)
