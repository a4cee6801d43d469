"""The block-scaled FP8 grouped product of a Mixture-of-Experts layer: ``jax_tma.fp8_ragged_dot``.

``fp8_ragged_dot(lhs, rhs, lhs_scale, rhs_scale, group_sizes)`` is ``lax.ragged_dot`` of the
dequantised operands, ``lhs * lhs_scale`` [M, K] (rows sorted by group) and each group's
``rhs[g] * rhs_scale[g]`` read as [K, N] from its K-major storage [N, K], accumulated in fp32 and
rounded once to bf16 (or fp32). The scales are what ``jax_tma.quantize_fp8`` writes: (1, 128)
blocks for the activations, ``quantize_fp8(lhs, (1, 128))`` -> [ceil(K / 128), M], and (128, 128)
blocks for each expert's weights, ``quantize_fp8(rhs, (128, 128))`` on [G, N, K] -> [G,
ceil(K / 128), ceil(N / 128)] (DeepSeek-V3's recipe), or one value per operand (per tensor).

On Hopper, e4m3 operands run one grouped kernel (csrc/contract/sm90_fp8_ragged_dot.h): the
ragged rows schedule of ``jax_tma.ragged_dot`` (group sizes read on the device, CUDA-graph safe)
with the FP8 mainloop of ``jax_tma.fp8_dot_general`` (e4m3 wgmma, partial sums promoted to fp32
every 128 K with the block scales). e5m2 operands, and every other platform, compute the same in
XLA (dequantise, fp32 ragged product). vmap folds into the kernel's batch; under a mesh the
tokens (M) and a batch keep their sharding and the experts' weights are replicated (K, N and G
are never split).

Gradients (DeepSeek-V3's FP8 training recipe, straight-through as ``fp8_dot_general``'s: the
cotangents are those of the dequantised operands, returned in bf16, the scales' zero). For the
output's cotangent dy [M, N]:
  lhs  dx = dy @ W per group, in FP8: dy quantised per row and 128 columns (``quantize_fp8(dy,
       (1, 128))`` in rhs's FP8 type), W as the transposed FP8 copy [G, K, N] with its 128 x 128
       scales transposed (the same blocks), so the product is this function's own grouped kernel.
  rhs  dW[g] = dy[rows of g]^T @ x[rows of g] ([G, N, K], rhs's layout) in bf16: the dequantised
       rows and dy through ``jax_tma.ragged_dot_general``'s contraction form (the bf16 grouped
       kernel; fp32 accumulation over each group's rows, one rounding).
With ``quantize_fp8`` (straight-through) in front, ``jax.grad`` reaches the bf16 or fp32 values
that were quantised: see ``jax_tma.moe_mlp(..., implementation="jax_tma_fp8")``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jax import lax

from jax_tma import _ext
from jax_tma._core import aval as _aval
from jax_tma.ops.fp8.config import (FP8_DTYPES, OUT_DTYPES, SCALE_BLOCK, Fp8Config,
                                    check_ragged_config)
from jax_tma.ops.fp8.quantize import dequantize_fp8, quantize_fp8
from jax_tma.ops.fp8.ragged_primitive import bind
from jax_tma.ops.ragged.api import ragged_dot_general
from jax_tma.ops.ragged.config import clamp_sizes

_NAME = "jax_tma.fp8_ragged_dot"


def _scale_form(scale, block_shape: tuple[int, ...], name: str, operand: str) -> bool:
    """True for a block scale of `block_shape`, False for one value; ValueError (TypeError for a
    non-float scale) naming the shapes otherwise."""
    shape = tuple(jnp.shape(scale))
    dtype = jnp.result_type(scale)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{_NAME}: {name} must be a float array (fp32 scales), got {dtype}")
    if shape == block_shape:
        return True
    if math.prod(shape) == 1 and len(shape) <= len(block_shape):
        return False
    raise ValueError(f"{_NAME}: {name} of shape {shape} is neither one value nor the block "
                     f"scales of {operand}: expected {block_shape}")


def _output_type(preferred_element_type) -> jnp.dtype:
    out = jnp.dtype(jnp.bfloat16 if preferred_element_type is None else preferred_element_type)
    if out not in OUT_DTYPES:
        raise ValueError(f"{_NAME}: preferred_element_type must be bfloat16 or float32, got "
                         f"{out.name}")
    return out


def fp8_ragged_dot(lhs: Any, rhs: Any, lhs_scale: Any, rhs_scale: Any, group_sizes: Any, *,
                   preferred_element_type: Any = jnp.bfloat16,
                   config: Fp8Config | None = None) -> jax.Array:
    """``lax.ragged_dot(lhs * lhs_scale, (rhs * rhs_scale)^T)`` on FP8 operands, in fp32.

    Args:
      lhs: [M, K] float8_e4m3fn (or float8_e5m2: XLA), the rows of every group one after
        another, sorted by group.
      rhs: [G, N, K], lhs's FP8 type: each group's weights K-major (as the FP8 tensor core
        reads them; ``rhs[g].T`` is the [K, N] matrix the rows multiply).
      lhs_scale: fp32 [ceil(K / 128), M], ``quantize_fp8(x, (1, 128))``'s scales of the rows per
        128 columns, or one value.
      rhs_scale: fp32 [G, ceil(K / 128), ceil(N / 128)], ``quantize_fp8(w, (128, 128))``'s
        scales of each group's [N, K] matrix per 128 x 128 block, or one value.
      group_sizes: [G] integers, rows per group, read on the device (never by the host). Sizes
        are clamped to [0, M], and the groups after the running sum reaches M cut off, as
        ``jax_tma.ragged_dot`` reads them; rows past the last group are zero.
      preferred_element_type: the output type, bfloat16 (default) or float32.
      config: an ``Fp8Config`` among ``FP8_RAGGED_CONFIGS`` for this product (by default a
        heuristic picks one); the gradient's product and a vmapped call take the heuristic's.

    Returns:
      [M, N] in preferred_element_type: row i is ``(lhs[i] * s_i) @ (rhs[g] * S_g)^T`` for the
      group g holding row i (the scales expanded over their blocks), summed in fp32 (on Hopper:
      promoted out of the tensor core every 128 K) and rounded once; zero past the last group.

    Gradients (module docstring): dx in FP8 (this product again), dW in bf16 (the bf16 grouped
    product), each on its Hopper kernel where the forward's would run, else in XLA; both are
    returned in bf16 and are the cotangents of the dequantised operands ``lhs * lhs_scale`` and
    ``rhs * rhs_scale`` (the scales get zero): differentiate through ``quantize_fp8`` to reach
    the values that were quantised.

    Raises:
      TypeError: operands not of one FP8 type, non-integer group sizes, non-float scales.
      ValueError: shapes that do not match (named in the message), an output type other than
        bf16 or fp32, a config that is not compiled for this product.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if jnp.dtype(x.dtype) not in FP8_DTYPES:
            raise TypeError(f"{_NAME}: {name} must be float8_e4m3fn or float8_e5m2, got "
                            f"{jnp.dtype(x.dtype).name}")
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"{_NAME}: lhs and rhs must share one FP8 type, got "
                        f"{jnp.dtype(lhs.dtype).name} and {jnp.dtype(rhs.dtype).name}")
    if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[2] != lhs.shape[1]:
        raise ValueError(f"{_NAME}: lhs must be [M, K] and rhs [G, N, K] with the same K, got "
                         f"shapes {lhs.shape} and {rhs.shape}")
    (m, k), (g, n, _) = lhs.shape, rhs.shape
    gs_shape = tuple(jnp.shape(group_sizes))
    if gs_shape != (g,):
        raise ValueError(f"{_NAME}: group_sizes must be [G] with G = rhs.shape[0] = {g}, got "
                         f"shape {gs_shape}")
    if not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer):
        raise TypeError(f"{_NAME}: group_sizes must be integers, got "
                        f"{jnp.result_type(group_sizes)}")
    kb, nb = -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)
    sa_block = _scale_form(lhs_scale, (kb, m), "lhs_scale", f"lhs {lhs.shape} (1 x 128 blocks)")
    sb_block = _scale_form(rhs_scale, (g, kb, nb), "rhs_scale",
                           f"rhs {rhs.shape} (128 x 128 blocks per group)")
    out_dtype = _output_type(preferred_element_type)
    if config is not None:
        config = check_ragged_config(Fp8Config.coerce(config, _NAME))
    sa = jnp.asarray(lhs_scale, jnp.float32)
    sb = jnp.asarray(rhs_scale, jnp.float32)
    sa = sa if sa_block else sa.reshape(())
    sb = sb if sb_block else sb.reshape(())
    _ext.warn_if_unavailable()
    return _product(lhs, rhs, sa, sb, jnp.asarray(group_sizes), sa_block, sb_block, out_dtype,
                    config)


def _forward(lhs, rhs, sa, sb, gs, sa_block, sb_block, out_dtype, config):
    out = bind(lhs[None], rhs[None], gs[None], sa[None] if sa_block else sa,
               sb[None] if sb_block else sb, sa_block=sa_block, sb_block=sb_block,
               out_dtype=out_dtype, config=config)
    return out[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _product(lhs, rhs, sa, sb, gs, sa_block, sb_block, out_dtype, config):
    return _forward(lhs, rhs, sa, sb, gs, sa_block, sb_block, out_dtype, config)


def _product_fwd(lhs, rhs, sa, sb, gs, sa_block, sb_block, out_dtype, config):
    out = _forward(lhs, rhs, sa, sb, gs, sa_block, sb_block, out_dtype, config)
    return out, (lhs, rhs, sa, sb, gs)


def gradients(lhs, sa, sa_block: bool, w_kn, s_kn, sb_block: bool, gs, ct, *, rhs_kn: bool,
              rhs_dtype, rhs_widths: tuple[int, ...] | None = None):
    """The product's gradients as DeepSeek-V3 takes them (module docstring), given its weights
    as [G, K, N] (`w_kn`, scales `s_kn` [G, Nb, Kb] or one; the layout whose N the rows'
    gradient contracts): (dx [M, K] in FP8 against those blocks, dy quantised per 1 x 128, in
    bf16; dW a bf16 grouped product of the dequantised rows and dy, [G, K, N] where `rhs_kn`
    else [G, N, K], in `rhs_dtype`). With `rhs_widths` (rhs_kn only: weights stored side by
    side along N), dW is a tuple of [G, K, N_i], one grouped product each over its columns of
    dy (a copy of dy's columns, not of the larger dW)."""
    bf16 = jnp.bfloat16
    # Sizes as the forward kernel read them (the bf16 product clamps alike on Hopper; lax, on
    # other platforms, gives negative sizes no meaning).
    gs = clamp_sizes(gs, lhs.shape[0])
    dyq, dys = quantize_fp8(ct, (1, SCALE_BLOCK), w_kn.dtype)         # [M, N], [Nb, M]
    d_lhs = _forward(dyq, w_kn, dys, s_kn, gs, True, sb_block, jnp.dtype(bf16), None)
    x = dequantize_fp8(lhs, sa, (1, SCALE_BLOCK) if sa_block else None).astype(bf16)
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[])

    def d_rhs(dy):
        a, b = (x, dy) if rhs_kn else (dy, x)
        return ragged_dot_general(a, b, gs, dims, preferred_element_type=rhs_dtype)

    dy = ct.astype(bf16)
    if rhs_widths is None:
        return d_lhs, d_rhs(dy)
    assert rhs_kn and sum(rhs_widths) == dy.shape[1], (rhs_widths, dy.shape)
    starts = [sum(rhs_widths[:i]) for i in range(len(rhs_widths))]
    return d_lhs, tuple(d_rhs(dy[:, s:s + w]) for s, w in zip(starts, rhs_widths))


def _product_bwd(sa_block, sb_block, out_dtype, config, saved, ct):
    """dx in FP8 (dy quantised per 1 x 128, W's FP8 blocks transposed), dW in bf16 (module
    docstring)."""
    del out_dtype, config
    lhs, rhs, sa, sb, gs = saved
    w_t = jnp.swapaxes(rhs, 1, 2)                                    # [G, K, N]
    s_t = jnp.swapaxes(sb, 1, 2) if sb_block else sb                 # [G, Nb, Kb]
    d_lhs, d_rhs = gradients(lhs, sa, sa_block, w_t, s_t, sb_block, gs, ct, rhs_kn=False,
                             rhs_dtype=jnp.bfloat16)
    cts = (d_lhs, d_rhs, jnp.zeros_like(sa), jnp.zeros_like(sb), None)
    return tuple(c if c is None else _aval.sum_to_varying(c, p) for c, p in zip(cts, saved))


_product.defvjp(_product_fwd, _product_bwd)
