"""The fused-epilogue patterns that bench_epilogues times and profile_gemm profiles, bf16 in and
out: jax_tma's fused op for each, XLA's unfused forms and XLA's dot alone, and the operand sets
they take. The patterns and their operands live together because every form of a pattern takes
the same operand tuple:

  gelu, residual, swiglu   (x [M, K], w [K, N], b [N], r [M, N], w2 [K, N], wc [K, 2N]);
                           wc is [w | w2], concatenated once when the operands are drawn
  swiglu_grad              (dy [M, K], wd [N, K], pre [2, M, N]): gated_mlp's backward product
                           and gated gradient, g = pre[0] and u = pre[1] the saved
                           pre-activations
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_tma
from jax_tma.ops.dense import api as ep_api

PATTERNS = ("gelu", "residual", "swiglu", "swiglu_grad")
NT = (((1,), (1,)), ((), ()))  # dimension numbers of dy [M, K] @ wd [N, K]^T


def fused(pattern: str, config=None) -> Callable:
    """jax_tma's fused op for `pattern` on `config` (None: the default's pick); for swiglu the
    config's block_n counts the gate's and the up's columns."""
    if pattern == "swiglu_grad":
        return lambda dy, wd, pre: ep_api._gated_grad_product(dy, wd, pre, "silu", config)
    if pattern == "gelu":
        return lambda x, w, b, r, w2, wc: jax_tma.dense(x, w, b, "gelu", config=config)
    if pattern == "residual":
        return lambda x, w, b, r, w2, wc: jax_tma.dense(x, w, b, residual=r, config=config)
    return lambda x, w, b, r, w2, wc: jax_tma.gated_dense(x, w, w2, "silu", config=config)


def _gated_grad_xla(dy, wd, pre):
    """XLA's form of the gated gradient: the product, then one fusion writing both
    cotangents (fp32 math, as gated_mlp's XLA path)."""
    h = jax.lax.dot_general(dy, wd, NT).astype(jnp.float32)
    g, u = pre[0].astype(jnp.float32), pre[1].astype(jnp.float32)
    s = jax.nn.sigmoid(g)
    return ((h * u * (s * (1 + g * (1 - s)))).astype(dy.dtype), (h * g * s).astype(dy.dtype))


def pattern_forms(pattern: str) -> dict[str, Callable]:
    """`pattern`'s contenders by name: "jax_tma" (the fused op, the default's pick), "xla" (XLA's
    unfused expression), for swiglu also "xla_concat" (one dot of [wg | wu], then the gating),
    and "xla_dot" (XLA's plain product: the floor; swiglu: of the concatenated weights)."""
    dot = lambda a, b: a @ b  # noqa: E731 - XLA's plain bf16 product: the floor
    if pattern == "swiglu_grad":
        return {
            "jax_tma": fused("swiglu_grad"),
            "xla": _gated_grad_xla,
            "xla_dot": lambda dy, wd, pre: jax.lax.dot_general(dy, wd, NT),
        }
    if pattern == "gelu":
        return {
            "jax_tma": fused("gelu"),
            "xla": lambda x, w, b, r, w2, wc: jax.nn.gelu(x @ w + b),
            "xla_dot": lambda x, w, b, r, w2, wc: dot(x, w),
        }
    if pattern == "residual":
        return {
            "jax_tma": fused("residual"),
            "xla": lambda x, w, b, r, w2, wc: x @ w + b + r,
            "xla_dot": lambda x, w, b, r, w2, wc: dot(x, w),
        }
    def concat_form(x, w, b, r, w2, wc):
        gu = x @ wc
        half = gu.shape[-1] // 2
        return jax.nn.silu(gu[..., :half]) * gu[..., half:]

    return {
        "jax_tma": fused("swiglu"),
        "xla": lambda x, w, b, r, w2, wc: jax.nn.silu(x @ w) * (x @ w2),
        "xla_concat": concat_form,
        "xla_dot": lambda x, w, b, r, w2, wc: dot(x, wc),
    }


def _normal_sets(seed, count, specs):
    """`count` tuples of bf16 arrays, one per (shape, divisor) of `specs`: standard normals over
    the divisor, each set drawing len(specs) consecutive keys of one split of `seed`."""
    keys = jax.random.split(jax.random.key(seed), len(specs) * count)
    sets = []
    for i in range(count):
        kk = keys[len(specs) * i: len(specs) * (i + 1)]
        sets.append(tuple(
            (jax.random.normal(key, shape, jnp.float32) / divisor).astype(jnp.bfloat16)
            for key, (shape, divisor) in zip(kk, specs)))
    return sets


def pattern_operands(pattern: str, shape: tuple[int, int, int], count: int,
                     seed: int) -> list[tuple]:
    """`count` operand tuples (the module docstring's) of `pattern` at M x N x K `shape`, drawn
    from the jax PRNG key of `seed`; weights scaled by 1/sqrt(K) so that outputs stay O(1)."""
    m, n, k = shape
    if pattern == "swiglu_grad":
        return _normal_sets(seed, count, [((m, k), 1.0), ((n, k), np.sqrt(k)), ((2, m, n), 0.5)])
    specs = [((m, k), 1.0), ((k, n), np.sqrt(k)), ((n,), 1.0), ((m, n), 1.0), ((k, n), np.sqrt(k))]
    return [(x, w, b, r, w2, jnp.concatenate([w, w2], axis=1))
            for x, w, b, r, w2 in _normal_sets(seed, count, specs)]
