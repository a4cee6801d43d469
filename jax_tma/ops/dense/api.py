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

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lax.lax import canonicalize_precision

from jax_tma import _ext
from jax_tma._core import aval as _aval
from jax_tma.ops.dense.config import (FORWARD, GATED, GATED_GRADIENT, GRADIENT,
                                      check_config)
from jax_tma.ops.dense.primitive import (ACTIVATIONS, GATED_ACTIVATIONS, _bias_operand, _bind,
                                         _activation_second, activate, activation_grad)
from jax_tma.ops.gemm.api import dot_general as _dot_general
from jax_tma.ops.gemm.config import KERNEL_INPUT_DTYPES, GemmConfig
from jax_tma.ops.gemm.primitive import kernel_precision


def _canonical(activation, allowed, what: str) -> str | None:
    if activation not in allowed:
        raise ValueError(f"jax_tma.{what}: activation must be one of "
                         f"{sorted(map(str, allowed))}, got {activation!r}")
    return "gelu_tanh" if activation == "gelu" else activation


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
        config = check_config(config, FORWARD, activation)
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
        config = check_config(config, GATED, activation)
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
        config = check_config(config, FORWARD, activation)
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
        config = check_config(config, GATED, activation)
    _ext.warn_if_unavailable()
    return _gated_mlp(x2, wg, wu, wd, residual, activation, config).reshape(*lead, n_out)
