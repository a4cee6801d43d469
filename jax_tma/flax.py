"""Flax layers on the fused kernels (``import jax_tma.flax``; needs flax).

linen:  ``Dense`` (nn.Dense with an activation and an optional residual in the epilogue),
        ``MLP`` (act(x @ w1 + b1) @ w2 + b2 [+ residual], jax_tma.mlp: the backward pass fuses
        the activation's derivative into a product), ``GatedMLP`` (SwiGLU / GeGLU,
        jax_tma.gated_mlp: the gate and up products and their combination in one kernel, then
        the down projection; the backward pass writes the gate's and up's cotangents from the
        epilogue of one product).
        ``MoE`` (top-k routed experts, jax_tma.moe_mlp: the experts' products on the grouped
        kernels, one device or expert-parallel over a mesh axis).
nnx:    ``NnxDense``, ``NnxMLP``, ``NnxGatedMLP``, ``NnxMoE``, the same layers as nnx modules.

Parameters have nn.Dense's names and layouts (``kernel`` [in, out], ``bias`` [out]; MLP:
``up`` and ``down``; GatedMLP: ``gate``, ``up``, ``down``), float32 by default; ``dtype`` is the
compute type (bf16 or fp16 runs the kernels; the bias is cast to it, as nn.Dense does). For the
plain ``dot_general=`` drop-in, pass ``jax_tma.dot_general`` to nn.Dense or nnx.Linear.
MoE's parameters: ``router`` [d, E], ``gate`` and ``up`` [E, d, F], ``down`` [E, F, d].
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jax_tma.ops.dense import api as dense_api
from jax_tma.ops.moe import api as moe_api

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


# --- Mixture of Experts -------------------------------------------------------------------------
_expert_init = nn.initializers.lecun_normal(batch_axis=(0,))  # fan-in of each expert's matrix
_MOE_SOWN = ("load_balancing_loss", "router_z_loss", "tokens_per_expert", "dropped_fraction")


def _moe_shapes(d: int, experts: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {"router": (d, experts), "gate": (experts, d, hidden), "up": (experts, d, hidden),
            "down": (experts, hidden, d)}


class MoE(nn.Module):
    """Top-k routed experts, x [..., d] -> [..., d] (jax_tma.moe_mlp; no residual added).

    The router (fp32) sends each token to ``top_k`` of ``num_experts`` experts; the tokens are
    sorted by expert on the device; each expert's MLP of width ``hidden_dim`` (gated: SwiGLU
    with "silu", GeGLU with "gelu"; else act(x @ up) @ down) runs on the grouped kernels; the
    results are un-sorted and mixed by the routing weights. Sown in "intermediates" on every
    call: ``load_balancing_loss`` (Switch / GShard form, 1 when balanced: scale it, often by
    1e-2, and add it to the loss; apply with ``mutable=["intermediates"]``),
    ``router_z_loss``, ``tokens_per_expert`` and ``dropped_fraction``.

    Attributes: num_experts; top_k; hidden_dim; activation; gated; dtype (the experts' compute
    type: bf16 and fp16 run the kernels); param_dtype; router ("softmax_topk" or
    "sigmoid_topk"); renormalize (weights over their sum); capacity_factor (None: exact, drops
    nothing; a float caps each expert's rows, see jax_tma.moe_mlp for what is dropped);
    expert_axis (a mesh axis: experts and tokens sharded over it, tokens exchanged with
    all_to_all; the expert parameters are annotated with it for nn.get_partition_spec);
    mesh (default: the one set with jax.set_mesh); implementation ("jax_tma", "jax_tma_fp8":
    the expert products in FP8 as jax_tma.moe_mlp says, or "xla": lax.ragged_dot, for
    comparisons); kernel_init (experts); router_init.
    """

    num_experts: int
    top_k: int
    hidden_dim: int
    activation: str | None = "silu"
    gated: bool = True
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    router: str = "softmax_topk"
    renormalize: bool = True
    capacity_factor: float | None = None
    expert_axis: str | None = None
    mesh: Any = None
    implementation: str = "jax_tma"
    kernel_init: Callable = _expert_init
    router_init: Callable = _default_kernel_init

    def __post_init__(self):
        moe_api.check_options("jax_tma.flax.MoE", num_experts=self.num_experts,
                              top_k=self.top_k, hidden_dim=self.hidden_dim,
                              activation=self.activation, gated=self.gated, router=self.router,
                              capacity_factor=self.capacity_factor,
                              implementation=self.implementation)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shapes = _moe_shapes(x.shape[-1], self.num_experts, self.hidden_dim)
        expert_init = self.kernel_init
        if self.expert_axis is not None:
            expert_init = nn.with_partitioning(expert_init, (self.expert_axis, None, None))
        router = self.param("router", self.router_init, shapes["router"], self.param_dtype)
        experts = {name: self.param(name, expert_init, shapes[name], self.param_dtype)
                   for name in (("gate", "up", "down") if self.gated else ("up", "down"))}
        y, stats = moe_api.moe_mlp(
            x, router, experts["up"], experts["down"], experts.get("gate"), top_k=self.top_k,
            activation=self.activation, router=self.router, renormalize=self.renormalize,
            capacity_factor=self.capacity_factor, expert_axis=self.expert_axis,
            mesh=self.mesh, dtype=self.dtype, implementation=self.implementation)
        for name in _MOE_SOWN:
            self.sow("intermediates", name, getattr(stats, name))
        return y


class NnxMoE(nnx.Module):
    """nnx form of ``MoE``. The statistics are sown as nnx.Intermediate under
    ``nnx.capture(layer, nnx.Intermediate)`` (flax versions without nnx.capture: on every
    call). With ``expert_axis`` the expert parameters are created sharded over it: construct
    inside ``jax.set_mesh(mesh)``."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, hidden_dim: int, *,
                 activation: str | None = "silu", gated: bool = True, dtype: Any = jnp.bfloat16,
                 param_dtype: Any = jnp.float32, router: str = "softmax_topk",
                 renormalize: bool = True, capacity_factor: float | None = None,
                 expert_axis: str | None = None, mesh: Any = None,
                 implementation: str = "jax_tma", kernel_init: Callable = _expert_init,
                 router_init: Callable = _default_kernel_init, rngs: nnx.Rngs):
        moe_api.check_options("jax_tma.flax.NnxMoE", num_experts=num_experts, top_k=top_k,
                              hidden_dim=hidden_dim, activation=activation, gated=gated,
                              router=router, capacity_factor=capacity_factor,
                              implementation=implementation)
        shapes = _moe_shapes(d_model, num_experts, hidden_dim)
        expert_init = kernel_init
        if expert_axis is not None:
            expert_init = nnx.with_partitioning(kernel_init, (expert_axis, None, None))
        self.router = _nnx_param(router_init, rngs, shapes["router"], param_dtype)
        self.gate = _nnx_param(expert_init, rngs, shapes["gate"], param_dtype) if gated else None
        self.up = _nnx_param(expert_init, rngs, shapes["up"], param_dtype)
        self.down = _nnx_param(expert_init, rngs, shapes["down"], param_dtype)
        self.options = dict(top_k=top_k, activation=activation, router=router,
                            renormalize=renormalize, capacity_factor=capacity_factor,
                            expert_axis=expert_axis, mesh=mesh, dtype=dtype,
                            implementation=implementation)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = None if self.gate is None else self.gate[...]
        y, stats = moe_api.moe_mlp(x, self.router[...], self.up[...], self.down[...], gate,
                                   **self.options)
        # NOTE: flax collects sown values through nnx.capture where it has it (sowing outside
        # it is deprecated there): the statistics are sown only under it.
        if not hasattr(nnx, "capture") or hasattr(self, "__captures__"):
            for name in _MOE_SOWN:
                self.sow(nnx.Intermediate, name, getattr(stats, name))
        return y
