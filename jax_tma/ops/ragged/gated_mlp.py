"""A gated Mixture-of-Experts MLP on the grouped kernels: ``jax_tma.gated_ragged_mlp``.

``gated_ragged_mlp(x, w_gate, w_up, w_down, group_sizes, activation)`` is
``ragged_dot(gated_ragged_dot(x, w_gate, w_up, group_sizes, activation), w_down, group_sizes)``:
every expert's SwiGLU ("silu") or GeGLU ("gelu") MLP over its rows, x [M, D] holding the rows of
G groups one after another, w_gate and w_up [G, D, F], w_down [G, F, D'].

Forward: the gated grouped kernel (which also saves the gate's and the up's pre-activations) and
the down projection's grouped product. Backward (``jax.custom_vjp``, as ``jax_tma.gated_mlp``'s):
the product ``dy @ w_down[g]^T`` writes the gate's and the up's cotangents from its epilogue
(``dh * up * act'(gate)`` and ``dh * act(gate)``, fp32, each rounded once: the gated gradient
rows mode, gated_grad_primitive.py), then dx from the rows form of both cotangents against
w_gate and w_up read transposed in place (summed in fp32), and the three weight gradients from
the contraction form: six grouped calls, every one a kernel on Hopper for bf16 or fp16 with silu
or the tanh GELU (the exact GELU's cotangents run in XLA). Elsewhere (no GPU, no extension, other
types) every call computes the same math through XLA. vmap, sharding (tokens sharded as
gated_ragged_dot's) and ``jax.export`` are the primitives'.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jax_tma import _ext
from jax_tma._core import aval as _aval
from jax_tma._core.activations import GATED_ACTIVATIONS
from jax_tma.ops.dense.api import _canonical, _kernel_computes
from jax_tma.ops.gemm.config import GemmConfig
from jax_tma.ops.ragged import gated_grad_primitive, gated_primitive
from jax_tma.ops.ragged.api import ragged_dot
from jax_tma.ops.ragged.config import CONTRACTION, ROWS, check_gated_config
from jax_tma.ops.ragged.gated import check_operands, gated_ragged_dot
from jax_tma.ops.ragged.primitive import _bind as _ragged_bind

_NAME = "gated_ragged_mlp"


def _rows(x, w, gs, w_k_major: bool, out_dtype):
    """ragged_dot's rows form of one batch entry: x [M, K], w [G, K, N] (or [G, N, K])."""
    return _ragged_bind(x[None], w[None], gs[None], ROWS, w_k_major, out_dtype)[0]


def _contraction(x, dy, gs, out_dtype):
    """ragged_dot's contraction form: x [M, K], dy [M, N] -> [G, K, N]."""
    return _ragged_bind(x[None], dy[None], gs[None], CONTRACTION, False, out_dtype)[0]


def _gated_grad(dy, wd, gs, pre, activation):
    """The gate's and the up's cotangents of ``act(gate) * up`` from the down projection's dy
    [M, D'] (wd [G, F, D'], pre [2, M, F]): one kernel, the product's epilogue (differentiable
    again through the primitive's JVP)."""
    d_gate, d_up = gated_grad_primitive.bind(dy[None], wd[None], gs[None], pre[:, None],
                                             activation=activation, out_dtype=dy.dtype)
    return d_gate[0], d_up[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gated_mlp(x, wg, wu, wd, gs, activation, config):
    return _gated_mlp_fwd(x, wg, wu, wd, gs, activation, config)[0]


def _gated_mlp_fwd(x, wg, wu, wd, gs, activation, config):
    # The weights compute in x's type; wider ones (_cast_weights_mlp) keep theirs for the
    # gradients, whose zero-size slices carry it.
    refs = tuple(w[:0] for w in (wg, wu, wd))
    wg, wu, wd = (w.astype(x.dtype) for w in (wg, wu, wd))
    h, pre = gated_primitive.bind(x[None], wg[None], wu[None], gs[None], activation=activation,
                                  save_pre=True, out_dtype=x.dtype, config=config)
    h, pre = h[0], pre[:, 0]
    y = _rows(h, wd, gs, False, x.dtype)
    return y, (x, wg, wu, wd, gs, h, pre, refs)


def _weight_grad(rows, ct, gs, ref, dtype):
    """A weight's gradient in its own type: fp32 weights take the kernel's fp32 sums."""
    wide = ref.dtype == jnp.float32
    return _contraction(rows, ct, gs, jnp.float32 if wide else dtype).astype(ref.dtype)


def _gated_mlp_bwd(activation, config, saved, dy):
    del config
    x, wg, wu, wd, gs, h, pre, refs = saved
    dy = dy.astype(x.dtype)
    # The gate's and the up's cotangents straight from the down product's epilogue.
    d_gate, d_up = _gated_grad(dy, wd, gs, pre, activation)
    dx = (_rows(d_gate, wg, gs, True, jnp.float32)
          + _rows(d_up, wu, gs, True, jnp.float32)).astype(x.dtype)
    dws = (_weight_grad(x, d_gate, gs, refs[0], x.dtype),
           _weight_grad(x, d_up, gs, refs[1], x.dtype),
           _weight_grad(h, dy, gs, refs[2], x.dtype))
    cts = (dx, *dws)
    return (*(_aval.sum_to_varying(c, p) for c, p in zip(cts, (x, *refs))), None)


_gated_mlp.defvjp(_gated_mlp_fwd, _gated_mlp_bwd)


def _check(x, w_gate, w_up, w_down, group_sizes):
    """gated_ragged_dot's operand checks, then w_down's and the operands' types; ValueError
    naming the shapes."""
    check_operands(f"jax_tma.{_NAME}", x, w_gate, w_up, group_sizes, k="D")
    g, _, f = jnp.shape(w_gate)
    if jnp.ndim(w_down) != 3 or jnp.shape(w_down)[:2] != (g, f):
        raise ValueError(f"jax_tma.{_NAME}: w_down must be [G, F, D'] with (G, F) = "
                         f"w_gate's {(g, f)}, got shape {jnp.shape(w_down)}")
    dtypes = {k: jnp.result_type(v) for k, v in
              (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))}
    bad = {k: str(t) for k, t in dtypes.items() if not jnp.issubdtype(t, jnp.inexact)}
    if bad:
        raise ValueError(f"jax_tma.{_NAME}: x and the weights must be floating point, got "
                         f"{bad}")


def _cast_weights_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                     group_sizes: jax.Array, activation: str) -> jax.Array:
    """gated_ragged_mlp computing in x's type with weights of any float type cast to it inside,
    so that fp32 weights of bf16 products get their gradients in fp32 from the kernels (no
    bf16 gradient converted after): the MoE layer's form for fp32 parameters."""
    activation = _canonical(activation, GATED_ACTIVATIONS, _NAME)
    _check(x, w_gate, w_up, w_down, group_sizes)
    _ext.warn_if_unavailable()
    return _gated_mlp(x, w_gate, w_up, w_down, jnp.asarray(group_sizes), activation, None)


def gated_ragged_mlp(x: Any, w_gate: Any, w_up: Any, w_down: Any, group_sizes: Any,
                     activation: str = "silu", *, precision=None, preferred_element_type=None,
                     config: GemmConfig | None = None) -> jax.Array:
    """``ragged_dot(gated_ragged_dot(x, w_gate, w_up, group_sizes, activation), w_down,
    group_sizes)``: every expert's gated (SwiGLU / GeGLU) MLP, with a fused backward pass.

    Args:
      x: [M, D], the rows of every group one after another, sorted by group.
      w_gate, w_up: [G, D, F], one matrix each per group. w_down: [G, F, D'].
      group_sizes: [G] integers, rows per group (read on the device), clamped as
        ``jax_tma.ragged_dot`` reads them.
      activation: "silu" (SwiGLU), "gelu" or "gelu_tanh" (tanh approximation), "gelu_erf".
      precision, preferred_element_type: as for ``lax.ragged_dot``; anything other than the
        kernels' computation (fp32 accumulation, results in the operands' type) runs the
        products unfused with these keywords (autodiff through XLA's rules).
      config: the gated forward kernel's ``GemmConfig`` (among ``GATED_RAGGED_CONFIGS``); the
        other products are configured by the heuristic.

    Returns:
      [M, D'] in the operands' promoted type; rows past the last group are zero. Its gradients
      follow the unfused expression's rounding: every product rounded to the operands' type, the
      cotangents of gate and up computed in fp32 and rounded once, dx summed in fp32.
    """
    activation = _canonical(activation, GATED_ACTIVATIONS, _NAME)
    _check(x, w_gate, w_up, w_down, group_sizes)
    dtype = jnp.result_type(x, w_gate, w_up, w_down)
    x, wg, wu, wd = (jnp.asarray(v, dtype) for v in (x, w_gate, w_up, w_down))
    gs = jnp.asarray(group_sizes)
    if not _kernel_computes(precision, preferred_element_type, dtype):
        keywords = dict(precision=precision, preferred_element_type=preferred_element_type)
        h = gated_ragged_dot(x, wg, wu, gs, activation, **keywords)
        return ragged_dot(h, wd.astype(h.dtype), gs, **keywords)
    if config is not None:
        config = check_gated_config(GemmConfig.coerce(config, f"jax_tma.{_NAME}"))
    _ext.warn_if_unavailable()
    return _gated_mlp(x, wg, wu, wd, gs, activation, config)
