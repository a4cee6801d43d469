"""Flax layers on the fused kernels (``import jax_tma.flax``; needs flax).

linen:  ``Dense`` (nn.Dense with an activation and an optional residual in the epilogue),
        ``MLP`` (act(x @ w1 + b1) @ w2 + b2 [+ residual], jax_tma.mlp: the backward pass fuses
        the activation's derivative into a product), ``GatedMLP`` (SwiGLU / GeGLU,
        jax_tma.gated_mlp: the gate and up products and their combination in one kernel, then
        the down projection; the backward pass writes the gate's and up's cotangents from the
        epilogue of one product).
nnx:    ``NnxDense``, ``NnxMLP``, ``NnxGatedMLP``, the same layers as nnx modules.

Parameters have nn.Dense's names and layouts (``kernel`` [in, out], ``bias`` [out]; MLP:
``up`` and ``down``; GatedMLP: ``gate``, ``up``, ``down``), float32 by default; ``dtype`` is the
compute type (bf16 or fp16 runs the kernels; the bias is cast to it, as nn.Dense does). For the
plain ``dot_general=`` drop-in, pass ``jax_tma.dot_general`` to nn.Dense or nnx.Linear.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jax_tma.ops.dense import api as dense_api

_default_kernel_init = nn.initializers.lecun_normal()


def _cast(dtype, *values):
    return tuple(None if v is None else jnp.asarray(v, dtype) for v in values)


def _dense_params(module, prefix: str, features_in: int, features_out: int):
    """A linen layer's ``{prefix}kernel`` [in, out] and, with use_bias, ``{prefix}bias`` [out]."""
    kernel = module.param(f"{prefix}kernel", module.kernel_init, (features_in, features_out),
                          module.param_dtype)
    bias = (module.param(f"{prefix}bias", module.bias_init, (features_out,), module.param_dtype)
            if module.use_bias else None)
    return kernel, bias


class Dense(nn.Module):
    """``act(x @ kernel + bias) + residual`` in one fused kernel.

    Attributes: features; activation (None, "relu", "gelu", "gelu_tanh", "gelu_erf", "silu");
    use_bias; dtype (compute type; default: the inputs' promoted type); param_dtype;
    kernel_init; bias_init.
    """

    features: int
    activation: str | None = None
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = _default_kernel_init
    bias_init: Callable = nn.initializers.zeros

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array:
        kernel, bias = _dense_params(self, "", x.shape[-1], self.features)
        dtype = self.dtype or jnp.result_type(x, kernel)
        x, kernel, bias, residual = _cast(dtype, x, kernel, bias, residual)
        return dense_api.dense(x, kernel, bias, self.activation, residual)


class MLP(nn.Module):
    """``act(x @ up + b_up) @ down + b_down (+ residual)`` (jax_tma.mlp)."""

    d_ff: int
    activation: str | None = "gelu"
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = _default_kernel_init
    bias_init: Callable = nn.initializers.zeros

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array:
        d = x.shape[-1]
        w1, b1 = _dense_params(self, "up_", d, self.d_ff)
        w2, b2 = _dense_params(self, "down_", self.d_ff, d)
        dtype = self.dtype or jnp.result_type(x, w1)
        x, w1, b1, w2, b2, residual = _cast(dtype, x, w1, b1, w2, b2, residual)
        return dense_api.mlp(x, w1, b1, w2, b2, self.activation, residual)


class GatedMLP(nn.Module):
    """``(act(x @ gate) * (x @ up)) @ down (+ residual)``: SwiGLU ("silu") or GeGLU ("gelu")."""

    d_ff: int
    activation: str = "silu"
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = _default_kernel_init

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array:
        d = x.shape[-1]
        wg = self.param("gate_kernel", self.kernel_init, (d, self.d_ff), self.param_dtype)
        wu = self.param("up_kernel", self.kernel_init, (d, self.d_ff), self.param_dtype)
        wd = self.param("down_kernel", self.kernel_init, (self.d_ff, d), self.param_dtype)
        dtype = self.dtype or jnp.result_type(x, wg)
        x, wg, wu, wd, residual = _cast(dtype, x, wg, wu, wd, residual)
        return dense_api.gated_mlp(x, wg, wu, wd, self.activation, residual)


def _nnx_param(init, rngs: nnx.Rngs, shape, dtype):
    return nnx.Param(init(rngs.params(), shape, dtype))


class NnxDense(nnx.Module):
    """nnx form of ``Dense``."""

    def __init__(self, in_features: int, out_features: int, *, activation: str | None = None,
                 use_bias: bool = True, dtype: Any = None, param_dtype: Any = jnp.float32,
                 kernel_init: Callable = _default_kernel_init, rngs: nnx.Rngs):
        self.kernel = _nnx_param(kernel_init, rngs, (in_features, out_features), param_dtype)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
        self.activation, self.dtype = activation, dtype

    def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array:
        kernel = self.kernel[...]
        bias = None if self.bias is None else self.bias[...]
        dtype = self.dtype or jnp.result_type(x, kernel)
        x, kernel, bias, residual = _cast(dtype, x, kernel, bias, residual)
        return dense_api.dense(x, kernel, bias, self.activation, residual)


class NnxMLP(nnx.Module):
    """nnx form of ``MLP``."""

    def __init__(self, d_model: int, d_ff: int, *, activation: str | None = "gelu",
                 use_bias: bool = True, dtype: Any = None, param_dtype: Any = jnp.float32,
                 kernel_init: Callable = _default_kernel_init, rngs: nnx.Rngs):
        self.up = NnxDense(d_model, d_ff, use_bias=use_bias, param_dtype=param_dtype,
                           kernel_init=kernel_init, rngs=rngs)
        self.down = NnxDense(d_ff, d_model, use_bias=use_bias, param_dtype=param_dtype,
                             kernel_init=kernel_init, rngs=rngs)
        self.activation, self.dtype = activation, dtype

    def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array:
        w1, w2 = self.up.kernel[...], self.down.kernel[...]
        b1 = None if self.up.bias is None else self.up.bias[...]
        b2 = None if self.down.bias is None else self.down.bias[...]
        dtype = self.dtype or jnp.result_type(x, w1)
        x, w1, b1, w2, b2, residual = _cast(dtype, x, w1, b1, w2, b2, residual)
        return dense_api.mlp(x, w1, b1, w2, b2, self.activation, residual)


class NnxGatedMLP(nnx.Module):
    """nnx form of ``GatedMLP``."""

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "silu", dtype: Any = None,
                 param_dtype: Any = jnp.float32, kernel_init: Callable = _default_kernel_init,
                 rngs: nnx.Rngs):
        self.gate = _nnx_param(kernel_init, rngs, (d_model, d_ff), param_dtype)
        self.up = _nnx_param(kernel_init, rngs, (d_model, d_ff), param_dtype)
        self.down = _nnx_param(kernel_init, rngs, (d_ff, d_model), param_dtype)
        self.activation, self.dtype = activation, dtype

    def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array:
        wg, wu, wd = self.gate[...], self.up[...], self.down[...]
        dtype = self.dtype or jnp.result_type(x, wg)
        x, wg, wu, wd, residual = _cast(dtype, x, wg, wu, wd, residual)
        return dense_api.gated_mlp(x, wg, wu, wd, self.activation, residual)
