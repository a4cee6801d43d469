"""``jax_tma.quantize_fp8`` and its inverse: a float array as FP8 values and fp32 scales, in the
layouts the FP8 kernel loads (see jax_tma/ops/fp8/api.py for the scale shapes per block).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_tma._core import aval as _aval
from jax_tma.ops.fp8.config import FP8_DTYPES, SCALE_BLOCK

BLOCKS = (None, (1, None), (None, 1), (1, 128), (128, 128))


def _fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def _block_scales(amax, dtype):
    """fp32 scales for block maxima: amax / max finite, 1 where the block is all zeros."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax > 0, amax / _fp8_max(dtype), 1.0).astype(jnp.float32)


def widen_fp8(values: Any) -> jax.Array:
    """FP8 values as fp32, exactly. The barrier keeps XLA from folding a quantisation just before
    (quantize_fp8 in the same computation) into this conversion: with excess precision allowed
    (its default) the GPU compiler drops the f32 -> FP8 -> f32 round trip and would compute with
    the values before they were rounded to FP8."""
    return lax.optimization_barrier(jnp.asarray(values)).astype(jnp.float32)


def _pad_to(x, axis: int, multiple: int):
    size = x.shape[axis]
    pad = -size % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _quantize_values(x, block, dtype):
    """(values, scales) of x for `block` (quantize_fp8's XLA form)."""
    x32 = x.astype(jnp.float32)
    limit = _fp8_max(dtype)
    rows, cols = x.shape[-2:] if x.ndim >= 2 else (1, x.shape[-1] if x.ndim else 1)
    if block is None:
        scale = _block_scales(jnp.max(jnp.abs(x32)), dtype)
        scaled = x32 / scale
    elif block == (1, None):
        scale = _block_scales(jnp.max(jnp.abs(x32), axis=-1, keepdims=True), dtype)
        scaled = x32 / scale
    elif block == (None, 1):
        scale = _block_scales(jnp.max(jnp.abs(x32), axis=-2, keepdims=True), dtype)
        scaled = x32 / scale
    elif block == (1, SCALE_BLOCK):
        xb = _pad_to(x32, -1, SCALE_BLOCK)
        xb = xb.reshape(*x.shape[:-1], -1, SCALE_BLOCK)                    # [.., R, Cb, 128]
        s = _block_scales(jnp.max(jnp.abs(xb), axis=-1), dtype)           # [.., R, Cb]
        scaled = (xb / s[..., None]).reshape(*x.shape[:-1], -1)[..., :cols]
        scale = jnp.swapaxes(s, -1, -2)                                   # [.., Cb, R]
    else:  # (128, 128)
        xb = _pad_to(_pad_to(x32, -1, SCALE_BLOCK), -2, SCALE_BLOCK)
        lead = x.shape[:-2]
        xb = xb.reshape(*lead, xb.shape[-2] // SCALE_BLOCK, SCALE_BLOCK,
                        xb.shape[-1] // SCALE_BLOCK, SCALE_BLOCK)          # [.., Rb, 128, Cb, 128]
        s = _block_scales(jnp.max(jnp.abs(xb), axis=(-3, -1)), dtype)     # [.., Rb, Cb]
        scaled = (xb / s[..., :, None, :, None]).reshape(
            *lead, xb.shape[-4] * SCALE_BLOCK, -1)[..., :rows, :cols]
        scale = jnp.swapaxes(s, -1, -2)                                   # [.., Cb, Rb]
    values = jnp.clip(scaled, -limit, limit).astype(dtype)
    return values, scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _quantize(x, block, dtype):
    return _quantize_values(x, block, dtype)


def _quantize_fwd(x, block, dtype):
    return _quantize(x, block, dtype), x.reshape(-1)[:0]  # x's dtype (and shard_map type)


def _quantize_bwd(block, dtype, residual, cts):
    ct_values, _ = cts
    # Straight-through: the values' cotangent (bf16 from fp8_dot_general) reaches x unchanged.
    return (_aval.sum_to_varying(ct_values.astype(residual.dtype), residual),)


_quantize.defvjp(_quantize_fwd, _quantize_bwd)


def quantize_fp8(x: Any, block: tuple | None = None,
                 dtype: Any = jnp.float8_e4m3fn) -> tuple[jax.Array, jax.Array]:
    """Quantises a float array to FP8 with fp32 scales: ``x ~= values * scale``.

    Args:
      x: a float array; block scales need x.ndim >= 2 and read x as [..., R, C].
      block: None (one scale), (1, None) per row, (None, 1) per column, (1, 128) per row and 128
        columns, (128, 128) per block (see the module docstring for the scales' shapes: block
        scales come as [ceil(C / 128), R] and [ceil(C / 128), ceil(R / 128)]).
      dtype: float8_e4m3fn (max 448) or float8_e5m2 (max 57344).

    Returns:
      (values of x's shape in `dtype`, fp32 scales). One XLA fusion per reduction and one for
      the values (benchmarks/bench_fp8.py times it). Differentiable straight through: the
      values' cotangent is x's.
    """
    x = jnp.asarray(x)
    if block is not None:
        block = tuple(block)
    if block not in BLOCKS:
        raise ValueError(f"jax_tma.quantize_fp8: block must be one of {BLOCKS}, got {block!r}")
    if jnp.dtype(dtype) not in FP8_DTYPES:
        raise ValueError(f"jax_tma.quantize_fp8: dtype must be float8_e4m3fn or float8_e5m2, "
                         f"got {jnp.dtype(dtype).name}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"jax_tma.quantize_fp8: x must be a float array, got {x.dtype.name}")
    if block is not None and x.ndim < 2:
        raise ValueError(f"jax_tma.quantize_fp8: block={block} needs x of rank >= 2, got shape "
                         f"{x.shape}")
    if x.size == 0:
        raise ValueError(f"jax_tma.quantize_fp8: x is empty (shape {x.shape})")
    return _quantize(x, block, jnp.dtype(dtype))


def dequantize_fp8(values: Any, scale: Any, block: tuple | None = None) -> jax.Array:
    """``values * scale`` in fp32, the scales expanded as ``quantize_fp8(..., block)`` wrote
    them (the inverse of quantize_fp8 up to rounding)."""
    values = widen_fp8(values)
    scale = jnp.asarray(scale, jnp.float32)
    if block is not None and tuple(block) in ((1, SCALE_BLOCK), (SCALE_BLOCK, SCALE_BLOCK)):
        rows, cols = values.shape[-2:]
        s = jnp.swapaxes(scale, -1, -2)                          # [.., R or Rb, Cb]
        s = jnp.repeat(s, SCALE_BLOCK, axis=-1)[..., :cols]
        if tuple(block)[0] == SCALE_BLOCK:
            s = jnp.repeat(s, SCALE_BLOCK, axis=-2)[..., :rows, :]
        return values * s
    return values * scale
