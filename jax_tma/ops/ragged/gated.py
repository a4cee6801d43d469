"""The gated grouped product of a Mixture-of-Experts MLP: ``jax_tma.gated_ragged_dot``.

``gated_ragged_dot(x, w_gate, w_up, group_sizes, activation)`` is
``act(ragged_dot(x, w_gate)) * ragged_dot(x, w_up)``: the first half of every expert's SwiGLU
("silu") or GeGLU ("gelu") MLP, x [M, K] holding the rows of G groups one after another and
w_gate, w_up [G, K, F] one matrix each per group. On Hopper, bf16 or fp16 operands of one type
run one grouped kernel (csrc/contract/sm90_ragged_dot.h, the gated rows mode): each CTA computes
the gate's and the up's columns of the same outputs in one mainloop and its epilogue stores
``act(gate) * up`` once, [M, F] instead of [M, 2F]. It rounds where the unfused 16-bit expression
rounds (each product, the activation, their product), each operation in fp32, as
``jax_tma.gated_dense`` does; rows past the last group are zero.

Gradients (``jax.custom_jvp``, as gated_dense's): differentiated, the forward kernel also stores
the gate's and the up's pre-activations g and u (two more outputs of the same kernel, clipped
per group like the result); the tangent is ``dg * act'(g) * u + du * act(g)`` with dg, du the
products' tangents through ragged_dot's primitive, so the backward pass is ragged_dot's
transposes: dx from the rows form against each weight read transposed in place, the weight
gradients from the contraction form, all kernels (five calls in all, with the forward one).
vmap, sharding (tokens, the batch and F keep their sharding; K is gathered) and ``jax.export``
are the primitive's (gated_primitive.py).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jax_tma import _ext
from jax_tma._core.activations import GATED_ACTIVATIONS, activate
from jax_tma.ops.dense.api import _canonical, _is_zero, _kernel_computes
from jax_tma.ops.dense.primitive import activation_grad
from jax_tma.ops.gemm.config import GemmConfig
from jax_tma.ops.ragged.api import ragged_dot
from jax_tma.ops.ragged.config import check_gated_config
from jax_tma.ops.ragged.gated_primitive import bind
from jax_tma.ops.ragged.primitive import rows_product

_NAME = "gated_ragged_dot"


def _products_tangent(x, w, gs, dx, dw):
    """ragged_dot(dx, w) + ragged_dot(x, dw) in fp32, None when both tangents are zero: ragged
    products of the operands' type on ragged_dot's primitive, so that their transposes (the
    backward pass) are ragged kernels too, the cotangent reaching them rounded to that type as
    the pre-activation's does in the unfused expression (and, as the primitive's rules are its
    own for every type, differentiable again)."""
    t = None
    for a, b, zero in ((dx, w, _is_zero(dx)), (x, dw, _is_zero(dw))):
        if not zero:
            term = rows_product(a[None], b[None], gs[None], a.dtype)[0].astype(jnp.float32)
            t = term if t is None else t + term
    return t


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _gated(x, wg, wu, gs, activation, config):
    out, = bind(x[None], wg[None], wu[None], gs[None], activation=activation, save_pre=False,
                out_dtype=x.dtype, config=config)
    return out[0]


def _gated_jvp(activation, config, primals, tangents):
    x, wg, wu, gs = primals
    dx, dwg, dwu, _ = tangents
    out, pre = bind(x[None], wg[None], wu[None], gs[None], activation=activation,
                    save_pre=True, out_dtype=x.dtype, config=config)
    out = out[0]
    g, u = pre[0, 0].astype(jnp.float32), pre[1, 0].astype(jnp.float32)
    dg, du = _products_tangent(x, wg, gs, dx, dwg), _products_tangent(x, wu, gs, dx, dwu)
    t = None
    if dg is not None:
        t = dg * activation_grad(activation, g) * u
    if du is not None:
        term = du * activate(activation, g)
        t = term if t is None else t + term
    return out, (jnp.zeros_like(out) if t is None else t.astype(out.dtype))


_gated.defjvp(_gated_jvp, symbolic_zeros=True)


def check_operands(op: str, x, w_gate, w_up, group_sizes, k: str = "K") -> None:
    """Shapes and types of a gated grouped product's operands (x [M, k], w_gate and w_up
    [G, k, F], group_sizes [G] integers) as the unfused expression needs them; ValueError naming
    them, `op` first."""
    shapes = {"x": jnp.shape(x), "w_gate": jnp.shape(w_gate), "w_up": jnp.shape(w_up),
              "group_sizes": jnp.shape(group_sizes)}
    if len(shapes["x"]) != 2:
        raise ValueError(f"{op}: x must be [M, {k}], got shape {shapes['x']}")
    size = shapes["x"][1]
    for key in ("w_gate", "w_up"):
        if len(shapes[key]) != 3 or shapes[key][1] != size:
            raise ValueError(f"{op}: {key} must be [G, {k}, F] with {k} = x.shape[1] = "
                             f"{size}, got shape {shapes[key]}")
    if shapes["w_gate"] != shapes["w_up"]:
        raise ValueError(f"{op}: w_gate and w_up must have one shape, got "
                         f"{shapes['w_gate']} and {shapes['w_up']}")
    if shapes["group_sizes"] != shapes["w_gate"][:1]:
        raise ValueError(f"{op}: group_sizes must be [G] with G = "
                         f"w_gate.shape[0] = {shapes['w_gate'][0]}, got shape "
                         f"{shapes['group_sizes']}")
    if not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer):
        raise ValueError(f"{op}: group_sizes must be integers, got "
                         f"{jnp.result_type(group_sizes)}")


def gated_ragged_dot(x: Any, w_gate: Any, w_up: Any, group_sizes: Any, activation: str = "silu",
                     *, precision=None, preferred_element_type=None,
                     config: GemmConfig | None = None) -> jax.Array:
    """``act(ragged_dot(x, w_gate)) * ragged_dot(x, w_up)`` in one grouped kernel: the gated
    (SwiGLU / GeGLU) first half of a Mixture-of-Experts MLP.

    Args:
      x: [M, K], the rows of every group one after another, sorted by group.
      w_gate, w_up: [G, K, F], one matrix each per group.
      group_sizes: [G] integers, rows per group (read on the device). Sizes are clamped to
        [0, M] and the groups after the running sum reaches M cut off, as ``jax_tma.ragged_dot``
        reads them.
      activation: "silu" (SwiGLU), "gelu" or "gelu_tanh" (tanh approximation), "gelu_erf".
      precision, preferred_element_type: as for ``lax.ragged_dot``; anything other than the
        kernel's computation (fp32 accumulation, output in the operands' type) runs the two
        products unfused with these keywords.
      config: a ``GemmConfig`` among ``GATED_RAGGED_CONFIGS`` (its block_n counts gate and up
        columns); by default a heuristic picks one.

    Returns:
      [M, F] in the operands' promoted type: row i is ``act(x[i] @ w_gate[g]) * (x[i] @
      w_up[g])`` for the group g holding row i, zero for rows past the last group. bf16 or fp16
      run the kernel; other types run XLA with the same rounding points.
    """
    activation = _canonical(activation, GATED_ACTIVATIONS, _NAME)
    check_operands(f"jax_tma.{_NAME}", x, w_gate, w_up, group_sizes)
    dtype = jnp.result_type(x, w_gate, w_up)
    x, wg, wu = (jnp.asarray(v, dtype) for v in (x, w_gate, w_up))
    gs = jnp.asarray(group_sizes)
    if not _kernel_computes(precision, preferred_element_type, dtype):
        keywords = dict(precision=precision, preferred_element_type=preferred_element_type)
        gate = ragged_dot(x, wg, gs, **keywords)
        return activate(activation, gate) * ragged_dot(x, wu, gs, **keywords)
    if config is not None:
        config = check_gated_config(GemmConfig.coerce(config, f"jax_tma.{_NAME}"))
    _ext.warn_if_unavailable()
    return _gated(x, wg, wu, gs, activation, config)
