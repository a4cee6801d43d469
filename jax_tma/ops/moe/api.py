"""A Mixture-of-Experts MLP on the grouped kernels: ``jax_tma.moe_mlp``.

  y, stats = moe_mlp(x, router_kernel, w_up, w_down, w_gate, top_k=8)

x [..., d] is routed token by token (the leading dims flattened: T tokens): router logits
``x @ router_kernel`` in fp32 ([d, E]), each token to its ``top_k`` experts with mixing weights.
The T * top_k (token, choice) pairs are sorted by expert on the device, so that each expert's
rows are one run, and every expert applies its MLP to its run as grouped products
(group sizes counted on the device):

  gated (w_gate given):  (act(rows @ w_gate[e]) * (rows @ w_up[e])) @ w_down[e]   (SwiGLU: silu)
  plain:                  act(rows @ w_up[e]) @ w_down[e]

Gated experts are ``jax_tma.gated_ragged_mlp``: one grouped kernel computes the gate's and the
up's columns of the same rows and stores act(gate) * up [rows, F] once (no [rows, 2F]
intermediate), then ``jax_tma.ragged_dot``'s down product; plain experts are two ragged_dot
products. Both round where the unfused expression rounds (each product, the activation, their
product). Differentiated, the gated kernel also saves the two pre-activations, and the backward
product dy @ w_down^T writes the gate's and the up's cotangents from its epilogue (the gated
gradient kernel): a bf16 training step of gated experts is the gated call, the gated gradient
call and 6 ragged_dot calls (forward: the down product; backward: the rows' gradient against
w_gate and w_up and the three weight gradients), of plain experts 6 ragged_dot calls. Gated
experts' weights are cast to the compute type inside that call, so that fp32 parameters take
their gradients from the kernels' fp32 sums.
The results are gathered back into token order and mixed by the weights in fp32:
y [..., d] = sum over a token's choices of weight * expert output, in the compute type. No
residual is added.

Routers ("router="):
  softmax_topk  p = softmax(logits) over the E experts; the top_k p; with renormalize the
                weights are those p over their sum (Mixtral, Qwen3-MoE), else p (Switch).
  sigmoid_topk  s = sigmoid(logits); the top_k s; with renormalize s over their sum, else s
                (DeepSeek-V3's scores, without its expert bias and group limit).

Statistics (MoeStats, fp32 scalars unless said):
  load_balancing_loss  E * sum_e f_e * P_e (Switch Transformer / GShard): f_e the share of the
                       T * top_k pairs routed to expert e (before any capacity), P_e the mean
                       over tokens of the router's probability of e (softmax; sigmoid scores
                       over their sum). 1 when routing is uniform; differentiable through P_e.
                       Scale it by a coefficient (often 1e-2) and add it to the loss.
  router_z_loss        mean over tokens of logsumexp(logits)^2 (ST-MoE).
  tokens_per_expert    [E] int32, pairs routed to each expert.
  dropped_fraction     share of the pairs the capacity dropped (0 without one).

Capacity: ``capacity_factor=None`` drops nothing: the result is the exact layer. A float caps
the rows an expert takes on one device at C = ceil(capacity_factor * T * top_k / E); with
expert parallelism it caps the rows one device sends another at
C = ceil(capacity_factor * T_local * top_k / n) (the exchange's buffers: n devices on the
axis). A pair past its cap is dropped: it adds nothing to its token's output (the token's
other choices still do, with their weights unchanged). Priority: every token's first choice
comes before any token's second, and so on; within a choice, tokens in order.

Expert parallelism (``expert_axis``): the experts and the tokens are sharded over that axis of
``mesh`` (or of the mesh set with ``jax.set_mesh``), the router replicated. Inside
``jax.shard_map`` each device routes its tokens and sorts its pairs by expert; each expert's
run goes to the device holding it with ``lax.ragged_all_to_all`` (only the routed rows move;
each run cut into pieces so that at least 128 slices go to each device, which XLA's copy
kernel spreads over as many CTAs), landing inside that expert's block of the receive buffer,
so the device runs its experts on what it received in place and sends the results back the
same way. The receive buffer holds n * C rows, C the rows one device may send another:
T_local * top_k without a capacity (so nothing is dropped), else the capacity above. Without
drops the result equals the one-device layer's up to summation order; the statistics are the
global ones. Other mesh axes are left to the compiler.

``implementation="jax_tma_fp8"`` runs every expert product in FP8, DeepSeek-V3's recipe, on
``jax_tma.fp8_ragged_dot``'s kernel. The rows are quantised per row and 128 columns (e4m3, one
XLA fusion each). Every expert's weights are quantised per 128 x 128 block each step (they stay
in their own type) by a one-pass quantiser on Hopper: it reads each weight once and writes its
e4m3 values in its own [E, K, N] layout (for the gradients) and K-major (for the forward
kernel), with the scales (``quantize_fp8``'s, with IEEE division). The gated half is one
product of the gate and up weights side by side (where F is not a multiple of 128 they are
concatenated first, and one block holds gate and up columns and shares their scale), then the
elementwise combination in fp32. Its gradients are ``fp8_ragged_dot``'s (the rows' in FP8
against the weights' e4m3 blocks, the weights' a bf16 product of the rows' FP8 values, one per
weight) straight through the quantisation, the weights' made in their own layout and type (fp32
weights take the kernel's fp32 sums). Results differ from the bf16 layer's by FP8's rounding
(about 3 % relative per product with e4m3's 3 mantissa bits, at random data).

``implementation="xla"`` runs the same layer with ``lax.ragged_dot`` (for comparisons; the gated
half as one product of the concatenated weights [E, d, 2F] and the elementwise combination).
Gradients flow through everything but the expert choice (the weights through lax.top_k's
values). Reverse mode only, except with "xla" (``jax.jvp`` of the kernels' layers raises: their
products and row gathers have custom_vjp rules).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_tma._core import aval as _aval
from jax_tma._core.activations import ACTIVATIONS, GATED_ACTIVATIONS, activate
from jax_tma.ops.fp8.quantize import quantize_fp8
from jax_tma.ops.fp8.quantize_primitive import quantize_blocks
from jax_tma.ops.fp8.ragged import fp8_ragged_dot
from jax_tma.ops.fp8.ragged import gradients as fp8_gradients
from jax_tma.ops.ragged.api import ragged_dot
from jax_tma.ops.ragged.gated_mlp import _cast_weights_mlp

ROUTERS = ("softmax_topk", "sigmoid_topk")
IMPLEMENTATIONS = ("jax_tma", "jax_tma_fp8", "xla")
# The compute types the FP8 products can return (fp8_ragged_dot's outputs).
FP8_COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_F32 = jnp.float32


class MoeStats(NamedTuple):
    """The router's statistics of one call (module docstring)."""

    load_balancing_loss: jax.Array
    router_z_loss: jax.Array
    tokens_per_expert: jax.Array
    dropped_fraction: jax.Array


class _Options(NamedTuple):
    experts: int
    top_k: int
    activation: str | None
    router: str
    renormalize: bool
    capacity_factor: float | None
    dtype: Any
    implementation: str


def check_options(op: str, *, num_experts: int, top_k: int, hidden_dim: int | None,
                  activation: str | None, gated: bool, router: str, capacity_factor: Any,
                  implementation: str) -> None:
    """ValueErrors naming `op` for options no call can take (also checked at a layer's
    construction)."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) \
            or num_experts < 1:
        raise ValueError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) \
            or not 1 <= top_k <= num_experts:
        raise ValueError(f"{op}: top_k must be an int in [1, num_experts={num_experts}], "
                         f"got {top_k!r}")
    if hidden_dim is not None and (isinstance(hidden_dim, bool)
                                   or not isinstance(hidden_dim, (int, np.integer))
                                   or hidden_dim < 1):
        raise ValueError(f"{op}: hidden_dim must be a positive int, got {hidden_dim!r}")
    allowed = GATED_ACTIVATIONS if gated else ACTIVATIONS
    if activation not in allowed:
        raise ValueError(f"{op}: activation must be one of {allowed} "
                         f"({'gated' if gated else 'plain'} experts), got {activation!r}")
    if router not in ROUTERS:
        raise ValueError(f"{op}: router must be one of {ROUTERS}, got {router!r}")
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(
            capacity_factor, (int, float, np.integer, np.floating)) or not capacity_factor > 0
            or not math.isfinite(capacity_factor)):
        raise ValueError(f"{op}: capacity_factor must be None (drop nothing) or a positive "
                         f"number, got {capacity_factor!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")


def _check_arrays(x, router_kernel, w_up, w_down, w_gate, dtype) -> tuple[int, int, int]:
    """(d, E, F) of consistent operands, else a ValueError or TypeError naming the shapes."""
    shapes = {"x": np.shape(x), "router_kernel": np.shape(router_kernel),
              "w_up": np.shape(w_up), "w_down": np.shape(w_down)}
    if w_gate is not None:
        shapes["w_gate"] = np.shape(w_gate)
    named = ", ".join(f"{k} {list(v)}" for k, v in shapes.items())
    for name, value in (("x", x), ("router_kernel", router_kernel), ("w_up", w_up),
                        ("w_down", w_down), ("w_gate", w_gate)):
        if value is not None and not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            raise TypeError(f"jax_tma.moe_mlp: {name} must be floating point, got "
                            f"{jnp.result_type(value)} ({named})")
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise TypeError(f"jax_tma.moe_mlp: dtype must be floating point, got {dtype!r}")
    if len(shapes["x"]) < 1 or len(shapes["router_kernel"]) != 2:
        raise ValueError(f"jax_tma.moe_mlp: x must be [..., d] and router_kernel [d, E]; got "
                         f"{named}")
    d = shapes["x"][-1]
    experts = shapes["router_kernel"][1]
    if len(shapes["w_up"]) != 3:
        raise ValueError(f"jax_tma.moe_mlp: w_up must be [E, d, F]; got {named}")
    hidden = shapes["w_up"][2]
    want = {"router_kernel": (d, experts), "w_up": (experts, d, hidden),
            "w_down": (experts, hidden, d)}
    if w_gate is not None:
        want["w_gate"] = (experts, d, hidden)
    if any(tuple(shapes[k]) != v for k, v in want.items()):
        raise ValueError(
            "jax_tma.moe_mlp: with x [..., d], router_kernel must be [d, E], w_up"
            f"{' and w_gate' if w_gate is not None else ''} [E, d, F] and w_down [E, F, d]; "
            f"got {named}")
    if min(d, experts, hidden) < 1:
        raise ValueError(f"jax_tma.moe_mlp: d, E and F must be positive; got {named}")
    return d, experts, hidden


def moe_mlp(x: Any, router_kernel: Any, w_up: Any, w_down: Any, w_gate: Any = None, *,
            top_k: int, activation: str | None = "silu", router: str = "softmax_topk",
            renormalize: bool = True, capacity_factor: float | None = None,
            expert_axis: str | None = None, mesh: Any = None, dtype: Any = None,
            implementation: str = "jax_tma") -> tuple[jax.Array, MoeStats]:
    """Top-k routed experts (module docstring): ``(y, stats)``.

    Args:
      x: [..., d] tokens.
      router_kernel: [d, E] (computed in fp32).
      w_up: [E, d, F]; w_gate: [E, d, F] or None (plain experts); w_down: [E, F, d].
      top_k: experts per token, in [1, E].
      activation: "silu", "gelu" (tanh approximation), "gelu_tanh", "gelu_erf"; plain experts
        also None and "relu".
      router: "softmax_topk" or "sigmoid_topk"; renormalize: weights over their sum.
      capacity_factor: None (drop nothing) or the rows an expert (or a device pair) takes, in
        units of its even share.
      expert_axis: a mesh axis to shard the experts and the tokens over (expert parallelism);
        mesh: its mesh (default: the one set with ``jax.set_mesh``).
      dtype: the experts' compute type (default x's); bf16 and fp16 run the kernels (bf16 or
        fp32 with "jax_tma_fp8").
      implementation: "jax_tma" (the grouped kernels), "jax_tma_fp8" (the FP8 grouped kernel,
        module docstring) or "xla" (``lax.ragged_dot``).

    Returns:
      y [..., d] in ``dtype``, and the router's MoeStats.
    """
    d, experts, _ = _check_arrays(x, router_kernel, w_up, w_down, w_gate, dtype)
    check_options("jax_tma.moe_mlp", num_experts=experts, top_k=top_k, hidden_dim=None,
                  activation=activation, gated=w_gate is not None, router=router,
                  capacity_factor=capacity_factor, implementation=implementation)
    x = jnp.asarray(x)
    if implementation == "jax_tma_fp8" and jnp.dtype(dtype or x.dtype) not in FP8_COMPUTE_DTYPES:
        raise ValueError(f"jax_tma.moe_mlp: implementation='jax_tma_fp8' computes in bfloat16 or "
                         f"float32 (dtype=, default x's), got {jnp.dtype(dtype or x.dtype).name}")
    lead = x.shape[:-1]
    tokens = math.prod(lead)
    options = _Options(experts, int(top_k), "gelu_tanh" if activation == "gelu" else activation,
                       router, bool(renormalize),
                       None if capacity_factor is None else float(capacity_factor),
                       jnp.dtype(dtype or x.dtype), implementation)
    weights = (router_kernel, w_gate, w_up, w_down)
    if tokens == 0:
        zeros = jnp.zeros((), _F32)
        return (jnp.zeros(x.shape, options.dtype),
                MoeStats(zeros, zeros, jnp.zeros((experts,), jnp.int32), zeros))
    x2 = x.reshape(tokens, d)
    if expert_axis is None:
        y, stats = _one_device(x2, weights, options)
    else:
        y, stats = _expert_parallel(x2, weights, options, expert_axis, mesh)
    return y.reshape(x.shape), stats


# --- Routing ------------------------------------------------------------------------------------
class _Routing(NamedTuple):
    choice: jax.Array  # [T, k] int32 experts
    weights: jax.Array  # [T, k] fp32 mixing weights
    counts: jax.Array  # [E] int32 pairs per expert
    prob_sum: jax.Array  # [E] fp32: sum over tokens of the router's probability
    z_sum: jax.Array  # fp32: sum over tokens of logsumexp(logits)^2


def _route(x: jax.Array, router_kernel: jax.Array, o: _Options) -> _Routing:
    logits = jnp.dot(x.astype(_F32), jnp.asarray(router_kernel, _F32),
                     precision=lax.Precision.HIGHEST)
    if o.router == "softmax_topk":
        probs = jax.nn.softmax(logits, axis=-1)
        scores = probs
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    top, choice = lax.top_k(scores, o.top_k)
    weights = top / jnp.sum(top, axis=-1, keepdims=True) if o.renormalize else top
    counts = jnp.zeros((o.experts,), jnp.int32).at[choice.reshape(-1)].add(1)
    z = jax.nn.logsumexp(logits, axis=-1)
    return _Routing(choice.astype(jnp.int32), weights, counts, jnp.sum(probs, axis=0),
                    jnp.sum(z * z))


def _stats(r: _Routing, tokens: int, dropped: jax.Array, o: _Options) -> MoeStats:
    """MoeStats from (summed) routing terms over `tokens` tokens."""
    pairs = tokens * o.top_k
    f = r.counts.astype(_F32) / pairs
    p = r.prob_sum / tokens
    return MoeStats(o.experts * jnp.sum(lax.stop_gradient(f) * p), r.z_sum / tokens, r.counts,
                    dropped.astype(_F32) / pairs)


# --- Dispatch -----------------------------------------------------------------------------------
class _Placement(NamedTuple):
    dest: jax.Array  # [P] buffer row of each pair; `rows` (out of range) where dropped
    rows: int  # buffer rows
    sizes: jax.Array  # [buckets] int32: pairs kept per bucket


def _place(bucket: jax.Array, buckets: int, capacity: int | None) -> _Placement:
    """Where each pair (in priority order) goes in a buffer holding each bucket's pairs as one
    run of at most `capacity` (None: all of them), the runs packed one after another."""
    pairs = bucket.shape[0]
    order = jnp.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    sizes = jnp.zeros((buckets,), jnp.int32).at[bucket].add(1)
    if capacity is None:
        rows, kept = pairs, sizes
        dest_sorted = jnp.arange(pairs, dtype=jnp.int32)
    else:
        position = jnp.arange(pairs, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[sorted_bucket]
        kept = jnp.minimum(sizes, capacity)
        rows = min(pairs, buckets * capacity)
        start = (jnp.cumsum(kept) - kept)[sorted_bucket]
        dest_sorted = jnp.where(position < capacity, start + position, rows)
    dest = jnp.zeros((pairs,), jnp.int32).at[order].set(dest_sorted)
    return _Placement(dest, rows, kept)


def _gather_rows(x: jax.Array, token: jax.Array, p: _Placement, o: _Options) -> jax.Array:
    """[p.rows, d]: each kept pair's token row at its buffer row, zeros elsewhere."""
    source = jnp.full((p.rows,), x.shape[0], jnp.int32).at[p.dest].set(token, mode="drop")
    if o.implementation == "xla":  # the comparison form keeps XLA's transpose (and jvp)
        return jnp.take(x.astype(o.dtype), source, axis=0, mode="fill", fill_value=0)
    # Token t's pairs are pairs j * T + t (choice-major): their rows, [T, k].
    tokens = x.shape[0]
    return _take_rows(x.astype(o.dtype), source, p.dest.reshape(-1, tokens).T)


def _combine(y_rows: jax.Array, p: _Placement, r: _Routing, o: _Options) -> jax.Array:
    """[T, d]: each token's pairs' rows (zero where dropped) mixed by its weights in fp32."""
    tokens, k = r.weights.shape
    if o.implementation == "xla":
        y_pair = jnp.take(y_rows, p.dest, axis=0, mode="fill", fill_value=0)
    else:
        pairs = p.dest.shape[0]
        pair_of_row = jnp.full((y_rows.shape[0],), pairs, jnp.int32).at[p.dest].set(
            jnp.arange(pairs, dtype=jnp.int32), mode="drop")
        y_pair = _take_rows(y_rows, p.dest, pair_of_row[:, None])
    y_pair = y_pair.reshape(k, tokens, -1).astype(_F32)
    return jnp.sum(r.weights.T[:, :, None] * y_pair, axis=0).astype(o.dtype)


# The kernels' layers differentiate the dispatch's and the combine's row gathers by gathers
# (_take_rows), not by XLA's transpose of a gather, a scatter-add of every row into the table,
# slower on the GPU (docs/notebook/2026-11-30-gather-backward.md). The price: no forward-mode
# derivative (the grouped kernels' custom_vjp rules have none either).
@jax.custom_vjp
def _take_rows(table: jax.Array, index: jax.Array, copies: jax.Array) -> jax.Array:
    """``table[index]`` (zero rows where an index is past the table), given `copies` [R, c]:
    for each of the table's R rows, the output rows that hold it (past the output: none), so
    that its cotangent is a gather of those rows and a sum, not a scatter-add."""
    return jnp.take(table, index, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(table, index, copies):
    return _take_rows(table, index, copies), copies


def _take_rows_bwd(copies, cotangent):
    rows = jnp.take(cotangent, copies.reshape(-1), axis=0, mode="fill", fill_value=0)
    summed = jnp.sum(rows.reshape(copies.shape + cotangent.shape[1:]).astype(_F32), axis=1)
    return summed.astype(cotangent.dtype), None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _pairs(r: _Routing) -> tuple[jax.Array, jax.Array]:
    """(expert, token) of every pair in priority order: choice-major (every token's first
    choice, then every token's second, ...)."""
    tokens, k = r.choice.shape
    return r.choice.T.reshape(-1), jnp.tile(jnp.arange(tokens, dtype=jnp.int32), k)


# --- Experts ------------------------------------------------------------------------------------
def _fp8_weights(ws: tuple) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The weights [E, K, N_i] side by side along N, quantised per 128 x 128 block in one pass
    (fp8.quantize_primitive: each weight read once): e4m3 [E, K, N], the same values K-major
    [E, N, K] for the forward kernel, and the scales [E, ceil(N / 128), ceil(K / 128)]. Where
    an N_i is not a multiple of 128, a block spans two weights."""
    return quantize_blocks(*ws, with_transpose=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_product(rows: jax.Array, ws: tuple, group_sizes: jax.Array, dtype) -> jax.Array:
    """ragged_dot(rows, concat(ws, N)) for weights [E, K, N_i] in FP8: rows per 1 x 128, the
    weights per 128 x 128 block, K-major for the kernel."""
    return _fp8_product_fwd(rows, ws, group_sizes, dtype)[0]


def _fp8_product_fwd(rows, ws, group_sizes, dtype):
    xq, xs = quantize_fp8(rows, (1, 128))
    wq, wq_t, wsc = _fp8_weights(ws)
    out = fp8_ragged_dot(xq, wq_t, xs, jnp.swapaxes(wsc, 1, 2), group_sizes,
                         preferred_element_type=dtype)
    refs = (rows.reshape(-1)[:0],) + tuple(w[:0, :1, :] for w in ws)  # types and widths, no data
    return out, (xq, xs, wq, wsc, group_sizes, refs)


def _fp8_product_bwd(dtype, saved, ct):
    """fp8_ragged_dot's gradients (fp8.ragged.gradients: the rows' in FP8 against the weights'
    e4m3 blocks, the weights' a bf16 product of the rows' FP8 values), with the weights'
    gradients in their own [E, K, N_i] layout: no transposes of the weights or their
    gradients."""
    del dtype
    xq, xs, wq, wsc, group_sizes, refs = saved
    # fp32 weights (the usual parameters) take the kernel's fp32 sums as they are: no bf16
    # gradient to convert in another pass.
    wide = any(r.dtype == _F32 for r in refs[1:])
    # One weight-gradient product per weight: no slicing of a concatenated [E, K, N] gradient
    # (a copy the size of the weights in fp32).
    d_rows, d_w = fp8_gradients(xq, xs, True, wq, wsc, True, group_sizes, ct, rhs_kn=True,
                                rhs_dtype=_F32 if wide else jnp.bfloat16,
                                rhs_widths=tuple(r.shape[-1] for r in refs[1:]))
    d_ws = [_aval.sum_to_varying(g.astype(r.dtype), r) for g, r in zip(d_w, refs[1:])]
    d_rows = _aval.sum_to_varying(d_rows.astype(refs[0].dtype), refs[0])
    return d_rows, tuple(d_ws), None


_fp8_product.defvjp(_fp8_product_fwd, _fp8_product_bwd)


def _fp8_experts(rows: jax.Array, group_sizes: jax.Array, weights, o: _Options) -> jax.Array:
    _, w_gate, w_up, w_down = weights
    if w_gate is None:
        h = _fp8_product(rows, (w_up,), group_sizes, o.dtype)
        h = activate(o.activation, h.astype(_F32)).astype(o.dtype)
    else:
        hidden = w_up.shape[-1]
        gu = _fp8_product(rows, (w_gate, w_up), group_sizes, o.dtype)
        gate = activate(o.activation, gu[:, :hidden].astype(_F32))
        h = (gate * gu[:, hidden:].astype(_F32)).astype(o.dtype)
    return _fp8_product(h, (w_down,), group_sizes, o.dtype)


def _experts(rows: jax.Array, group_sizes: jax.Array, weights, o: _Options) -> jax.Array:
    """Every expert's MLP on its run of `rows` (rows past the groups come out zero)."""
    if o.implementation == "jax_tma_fp8":
        return _fp8_experts(rows, group_sizes, weights, o)
    _, w_gate, w_up, w_down = weights
    kernels = o.implementation == "jax_tma"
    dot = ragged_dot if kernels else lax.ragged_dot
    dtype = o.dtype
    if w_gate is None:
        h = dot(rows, jnp.asarray(w_up, dtype), group_sizes)
        h = activate(o.activation, h.astype(_F32)).astype(dtype)
    elif kernels:
        # The weights are cast to the compute type inside the grouped MLP, so that fp32
        # parameters get their gradients from the kernels' fp32 sums: a cast before it would
        # convert bf16 gradients in another pass the size of the weights, each step.
        # (o.activation is already canonical: "gelu" -> "gelu_tanh".)
        return _cast_weights_mlp(rows, jnp.asarray(w_gate), jnp.asarray(w_up),
                                 jnp.asarray(w_down), group_sizes, o.activation)
    else:
        # One lax.ragged_dot of the concatenated weights [E, d, 2F] (one read of the rows; the
        # concatenation fuses into the cast to the compute type), rounded as the kernel rounds.
        hidden = w_up.shape[-1]
        w = jnp.concatenate([jnp.asarray(w_gate, dtype), jnp.asarray(w_up, dtype)], axis=-1)
        gu = dot(rows, w, group_sizes)
        gate = activate(o.activation, gu[:, :hidden].astype(_F32)).astype(dtype)
        h = (gate.astype(_F32) * gu[:, hidden:].astype(_F32)).astype(dtype)
    return dot(h, jnp.asarray(w_down, dtype), group_sizes)


def _one_device(x: jax.Array, weights, o: _Options) -> tuple[jax.Array, MoeStats]:
    tokens = x.shape[0]
    r = _route(x, weights[0], o)
    expert, token = _pairs(r)
    capacity = (None if o.capacity_factor is None
                else math.ceil(o.capacity_factor * tokens * o.top_k / o.experts))
    p = _place(expert, o.experts, capacity)
    y_rows = _experts(_gather_rows(x, token, p, o), p.sizes, weights, o)
    dropped = tokens * o.top_k - jnp.sum(p.sizes)
    return _combine(y_rows, p, r, o), _stats(r, tokens, dropped, o)


# --- Expert parallelism -------------------------------------------------------------------------
def _expert_parallel(x: jax.Array, weights, o: _Options, axis: str,
                     mesh: Any) -> tuple[jax.Array, MoeStats]:
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    names = tuple(getattr(mesh, "axis_names", ()))
    if axis not in names:
        where = (f"the mesh's axes are {names}" if names
                 else "no mesh is set: pass mesh= or call inside jax.set_mesh(mesh)")
        raise ValueError(f"jax_tma.moe_mlp: expert_axis={axis!r} is not an axis of the mesh; "
                         f"{where}")
    devices = int(dict(mesh.shape)[axis])
    tokens = x.shape[0]
    if o.experts % devices or tokens % devices:
        raise ValueError(
            f"jax_tma.moe_mlp: with expert_axis={axis!r} of {devices} devices, the experts "
            f"({o.experts}) and the tokens ({tokens}, x's leading dims) must be multiples of "
            f"{devices}")
    local_tokens = tokens // devices
    capacity = (local_tokens * o.top_k if o.capacity_factor is None
                else min(local_tokens * o.top_k,
                         math.ceil(o.capacity_factor * local_tokens * o.top_k / devices)))
    router_kernel, w_gate, w_up, w_down = weights
    specs = (P(axis), P(), None if w_gate is None else P(axis), P(axis), P(axis))
    body = functools.partial(_expert_parallel_body, o=o, axis=axis, devices=devices,
                             capacity=capacity)
    stat_specs = MoeStats(P(), P(), P(), P())
    run = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(axis), stat_specs),
                        axis_names={axis})
    args = (x, router_kernel, w_gate, w_up, w_down)
    if jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())):
        # Explicit axes: shard_map takes arguments already laid out as its specs say.
        args = tuple(None if a is None else jax.sharding.reshard(a, NamedSharding(mesh, spec))
                     for a, spec in zip(args, specs))
    return run(*args)


def _expert_parallel_body(x, router_kernel, w_gate, w_up, w_down, *, o: _Options, axis: str,
                          devices: int, capacity: int) -> tuple[jax.Array, MoeStats]:
    """One device's share: its tokens x [T / n, d] and its E / n experts' weights.

    The pairs are sorted by expert (at most `capacity` per destination device, in priority
    order), and each expert's run goes to the device holding it as one ragged slice. There it
    lands inside that expert's block, after the slices of the devices before the sender, so
    the received rows are already grouped by expert: only the pairs routed move, and the
    experts run on them in place. Their results go back the same way, reversed.
    """
    tokens, d = x.shape
    local = o.experts // devices
    r = _route(x, router_kernel, o)
    expert, token = _pairs(r)
    pairs = expert.shape[0]
    if capacity < pairs:  # the pairs past `capacity` to one device are dropped (bucket E)
        capped = _place(expert // local, devices, capacity)
        expert = jnp.where(capped.dest < capped.rows, expert, o.experts)
    p = _place(expert, o.experts + 1, None)
    counts = p.sizes[:o.experts]  # pairs this device sends each expert
    p = _Placement(jnp.where(expert < o.experts, p.dest, pairs), pairs, counts)
    send = _gather_rows(x, token, p, o)  # [pairs, d], by expert, dropped pairs last

    me = lax.axis_index(axis)
    sent = lax.all_gather(counts, axis)  # [n, E]: pairs device s sends expert e
    totals = jnp.sum(sent, axis=0).reshape(devices, local)
    block = (jnp.cumsum(totals, axis=1) - totals).reshape(-1)  # expert e's rows start there
    before = jnp.cumsum(sent, axis=0) - sent  # rows of e from the devices before s
    offset = jnp.cumsum(counts) - counts  # expert e's run in `send`
    mine = lax.dynamic_slice_in_dim(sent, me * local, local, axis=1)  # [n, local] to me
    runs = jnp.cumsum(sent, axis=1) - sent  # expert e's run in device s's `send`
    # Where the rows of (sender s, my expert l) lie among my experts' rows, grouped by expert.
    grouped = (lax.dynamic_slice_in_dim(block, me * local, local)[None, :]
               + lax.dynamic_slice_in_dim(before, me * local, local, axis=1)).reshape(-1)
    rows = devices * capacity
    received = _ragged_exchange(axis, devices, rows, send, offset, counts, block + before[me],
                                mine.reshape(-1))
    y = _experts(received, jnp.sum(mine, axis=0), (None, w_gate, w_up, w_down), o)

    # Back: the rows of (sender s, my expert l) to s, at expert l's run in s's `send`.
    back = _ragged_exchange(
        axis, devices, pairs, y, grouped, mine.reshape(-1),
        lax.dynamic_slice_in_dim(runs, me * local, local, axis=1).reshape(-1), counts)
    dropped = tokens * o.top_k - jnp.sum(counts)
    summed = _Routing(r.choice, r.weights, lax.psum(r.counts, axis), lax.psum(r.prob_sum, axis),
                      lax.psum(r.z_sum, axis))
    stats = _stats(summed, tokens * devices, lax.psum(dropped, axis), o)
    return _combine(back, p, r, o), stats


# Slices per destination device the exchange is cut into (at least). XLA's single-host
# ragged all-to-all copies each slice with one CTA of 128 threads, so that a few large slices
# (a few experts a device) leave the copy far below NVLink's rate; more, shorter slices of the
# same rows spread it over more CTAs. On two H200s, 128 against whole slices: the exchange's
# kernels 6.3 against 45.3 ms a DeepSeek-like step (docs/notebook/2026-11-30-ep-slices-and-
# fp8-scales.md).
_EXCHANGE_SLICES = 128


def _split_slices(pieces: int, input_offsets, send_sizes, output_offsets, recv_sizes):
    """The exchange's slices, each cut into `pieces` consecutive runs of ceil(size / pieces)
    rows (the last ones shorter or empty), in order: slice i's piece j is slice i * pieces + j,
    so that slices stay grouped by destination. Sender and receiver cut a slice alike, the
    sender from its send size, the receiver from its receive size (the same number)."""
    j = jnp.arange(pieces, dtype=send_sizes.dtype)[None, :]

    def cut(sizes):
        step = (sizes + pieces - 1) // pieces
        start = jnp.minimum(j * step[:, None], sizes[:, None])
        return start, jnp.minimum(step[:, None], sizes[:, None] - start)

    start, sent = cut(send_sizes)
    _, received = cut(recv_sizes)
    return ((input_offsets[:, None] + start).reshape(-1), sent.reshape(-1),
            (output_offsets[:, None] + start).reshape(-1), received.reshape(-1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ragged_exchange(axis: str, devices: int, rows: int, operand, input_offsets, send_sizes,
                     output_offsets, recv_sizes) -> jax.Array:
    """[rows, d]: ``lax.ragged_all_to_all`` of `operand` into zeros (slice i to device
    i // (slices / n), written there at `output_offsets[i]`). Its gradient is the same
    exchange backwards (only the offsets are saved)."""
    output = jnp.zeros((rows, operand.shape[1]), operand.dtype)
    return _exchange_once(axis, devices, operand, output, input_offsets, send_sizes,
                          output_offsets, recv_sizes)


def _exchange_fwd(axis, devices, rows, operand, *meta):
    shape = jnp.zeros((operand.shape[0], 0), operand.dtype)  # operand's rows, as a residual
    return _ragged_exchange(axis, devices, rows, operand, *meta), (meta, shape)


def _exchange_bwd(axis, devices, rows, residuals, cotangent):
    """Each received slice's cotangent back to its sender, at the rows it came from."""
    (input_offsets, send_sizes, output_offsets, recv_sizes), shape = residuals
    landed = lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # where mine landed here
    came_from = lax.all_to_all(input_offsets, axis, 0, 0, tiled=True)
    output = jnp.zeros((shape.shape[0], cotangent.shape[1]), cotangent.dtype)
    grad = _exchange_once(axis, devices, cotangent, output, landed, recv_sizes, came_from,
                          send_sizes)
    return grad, None, None, None, None


_ragged_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _exchange_once(axis: str, devices: int, operand, output, input_offsets, send_sizes,
                   output_offsets, recv_sizes) -> jax.Array:
    """``lax.ragged_all_to_all`` where the platform has it. XLA:CPU has none: there each
    device sends every row, with its place (or none), in fixed [n, rows] buffers through
    ``lax.all_to_all``, and the receiver writes them in place; the same result."""
    def ragged(*args):
        return lax.ragged_all_to_all(*args, axis_name=axis)

    def fixed(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        del recv_sizes
        rows = jnp.arange(operand.shape[0], dtype=jnp.int32)
        inside = ((rows[None, :] >= input_offsets[:, None])
                  & (rows[None, :] < (input_offsets + send_sizes)[:, None]))  # [slices, rows]
        piece = jnp.argmax(inside, axis=0)
        to = jnp.where(jnp.any(inside, axis=0), piece // (input_offsets.shape[0] // devices),
                       devices)
        at = output_offsets[piece] + rows - input_offsets[piece]
        mask = to[None, :] == jnp.arange(devices, dtype=jnp.int32)[:, None]  # [n, rows]
        buffers = jnp.where(mask[:, :, None], operand[None], 0)
        places = jnp.where(mask, at[None, :], output.shape[0])
        buffers = lax.all_to_all(buffers, axis, 0, 0, tiled=False)
        places = lax.all_to_all(places, axis, 0, 0, tiled=False)
        return output.at[places.reshape(-1)].set(
            buffers.reshape(-1, operand.shape[-1]), mode="drop")

    output = lax.pcast(output, (axis,), to="varying")  # each device's own buffer
    pieces = -(-_EXCHANGE_SLICES // max(1, input_offsets.shape[0] // devices))
    if pieces > 1:
        input_offsets, send_sizes, output_offsets, recv_sizes = _split_slices(
            pieces, input_offsets, send_sizes, output_offsets, recv_sizes)
    return lax.platform_dependent(operand, output, input_offsets, send_sizes, output_offsets,
                                  recv_sizes, cpu=fixed, default=ragged)
