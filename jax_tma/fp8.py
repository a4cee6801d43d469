"""FP8 products on Hopper: ``jax_tma.quantize_fp8``, ``jax_tma.fp8_matmul``,
``jax_tma.fp8_dot_general`` and the primitive behind them.

``quantize_fp8(x, block)`` turns a float array into (values, scales) with ``x ~= values * scale``
(float8_e4m3fn or float8_e5m2 values, fp32 scales, each scale the block's absolute maximum over
the format's largest finite value). For x stored [R, C]:

  block=None         one scale for the tensor: shape ()
  block=(1, None)    one per row: [R, 1]            block=(None, 1)  one per column: [1, C]
  block=(1, 128)     one per row per 128 columns: [ceil(C / 128), R], scale[c // 128, r]
  block=(128, 128)   one per 128 x 128 block: [ceil(C / 128), ceil(R / 128)],
                     scale[c // 128, r // 128]

Block scales come transposed (column blocks outermost): the layout the kernel loads them in by
TMA, one row of scales per K slice, when C is the contracted dimension (activations [M, K] with
(1, 128): DeepSeek-V3's recipe; weights [N, K] with (128, 128)).

``fp8_dot_general(lhs, rhs, lhs_scale, rhs_scale, dimension_numbers)`` computes
``dot_general(lhs * lhs_scale, rhs * rhs_scale)`` (the scales broadcast or block-expanded as
above) for 2-D FP8 operands, in fp32, rounded once to ``out_dtype`` (bf16 or fp32), plus an
optional fp32 bias over the output's columns. On Hopper it runs the sm90 FP8 kernel
(csrc/kernels/sm90_fp8.h): e4m3 or e5m2 wgmma, the tensor core's partial sums promoted to fp32
registers every 128 K with the block scales, per-tensor / row / column scales and the bias in the
epilogue. The kernel reads both operands K-major: an operand stored with K first ([K, M] or
[K, N]) is transposed by XLA first. Scale forms per operand, tried in this order (the first whose
shape matches wins): per tensor (one element); (1, 128) blocks along K (operands stored with K
last); (128, 128) blocks; a vector over the operand's free dimension ([R, 1] when K is the
columns, [1, C] when K is the rows). Scales that vary along K within a block of 128 are not
accepted. Both operands of one FP8 type run the kernel; other combinations compute the same in
XLA (dequantise, fp32 dot), as does every other platform.

Gradients (straight-through): quantisation is treated as the identity. ``quantize_fp8`` passes
its values' cotangent to x unchanged (scales get none), and ``fp8_dot_general``'s cotangents for
lhs and rhs are those of the dequantised operands, computed in bf16 by ``jax_tma.dot_general``
(the bf16 Hopper kernel where it runs, XLA elsewhere) and returned as bf16 (not rounded to FP8);
the scales and the bias get zero and the bias's reduction of the cotangent respectively. So
``jax.grad`` of ``fp8_matmul(*quantize_fp8(x, (1, 128)), *quantize_fp8(w, (128, 128)))`` is the
bf16 gradient of ``x @ w`` evaluated at the dequantised operands.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lax.lax import canonicalize_precision
from jax.interpreters import batching

from jax_tma import _ext, fp8_sharding
from jax_tma._core import aval as _aval
from jax_tma._core import device
from jax_tma._core.primitive import (bind_local, define_primitive, kernel_ffi_call,
                                     sum_split_partials)
from jax_tma._core.aval import result_aval
from jax_tma.gemm import dot_general as _bf16_dot_general

KERNEL_TARGET = "jax_tma_fp8_gemm_sm90"
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
SCALE_BLOCK = 128
BLOCKS = (None, (1, None), (None, 1), (1, 128), (128, 128))
# (block_m, block_n, stages, cluster_m) of JAX_TMA_SM90_FP8_TILES (csrc/kernels/sm90_fp8.h), and
# Fp8UnpromotedTile, compiled without promotion for e4m3 with fp32 output only.
_FP8_TILES = ((128, 256, 3, 2), (128, 256, 3, 1), (128, 128, 5, 2), (128, 128, 5, 1),
              (64, 256, 4, 1), (64, 128, 7, 1))
_UNPROMOTED_TILE = (128, 128, 5, 1)
MAX_SPLIT_K = 8
# Kernel limits: operand rows of 16 bytes (K), output rows of 16 bytes (N, bf16), scale rows of
# 16 bytes (M and ceil(N / 128) for the block scales' rows, padded where not).
_K_MULTIPLE, _N_MULTIPLE, _SCALE_ROW_MULTIPLE = 16, 8, 4
# The epilogue's scale vectors (attribute values of ffi/fp8.cc).
NONE, SCALAR, VECTOR = "none", "scalar", "vector"
_VECTOR_CODE = {NONE: 0, SCALAR: 1, VECTOR: 2}


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """One compiled tile of the FP8 kernel, with a split-K factor.

    Attributes:
      block_m, block_n: the CTA tile (128-row tiles: two consumer warpgroups of 64 rows; 64-row
        tiles: ping-pong). stages: depth of the ring of 128-deep K slices. cluster_m: 2 pairs
        vertically adjacent tiles that multicast B.
      split_k: K ranges computed apart as fp32 partial products and summed by XLA (for products
        with few output tiles and a long K).
    """

    block_m: int = 128
    block_n: int = 256
    stages: int = 3
    cluster_m: int = 2
    split_k: int = 1

    def __post_init__(self) -> None:
        if self.tile not in _FP8_TILES:
            choices = "; ".join(f"block_m={t[0]}, block_n={t[1]}, stages={t[2]}, cluster_m={t[3]}"
                                for t in _FP8_TILES)
            raise ValueError(f"jax_tma: Fp8Config({self.describe()}) is not a compiled FP8 tile; "
                             f"choose one of: {choices}")
        if not (isinstance(self.split_k, int) and 1 <= self.split_k <= MAX_SPLIT_K):
            raise ValueError(f"jax_tma: Fp8Config split_k must be an int in [1, {MAX_SPLIT_K}], "
                             f"got {self.split_k!r}")

    @property
    def tile(self) -> tuple[int, int, int, int]:
        return (self.block_m, self.block_n, self.stages, self.cluster_m)

    def splits_for(self, k: int) -> int:
        """K ranges actually used for a depth of k: at most split_k, none of them empty."""
        k_blocks = -(-k // SCALE_BLOCK)
        per_split = -(-k_blocks // min(self.split_k, k_blocks))
        return -(-k_blocks // per_split)

    def describe(self) -> str:
        return (f"block_m={self.block_m}, block_n={self.block_n}, stages={self.stages}, "
                f"cluster_m={self.cluster_m}, split_k={self.split_k}")


FP8_CONFIGS: tuple[Fp8Config, ...] = tuple(Fp8Config(*t) for t in _FP8_TILES)

# Cost model: relative wgmma throughput per tile (128 x 256 the best), the chip's FP8 rate.
_TILE_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.9, (64, 256): 0.8, (64, 128): 0.7}
_PEAK_FLOPS = 1.979e15


def estimate_seconds(cfg: Fp8Config, m: int, n: int, k: int, num_sms: int,
                     dram_bytes_per_s: float) -> float:
    """A rough time of one product on `cfg`: waves of tiles at the tile's rate, or the operand
    and output bytes at DRAM speed, whichever is longer; split-K adds its fp32 partial products'
    round trip through memory and XLA's sum after the kernel."""
    m_blocks, n_blocks = -(-m // cfg.block_m), -(-n // cfg.block_n)
    splits = cfg.splits_for(k)
    units = m_blocks * n_blocks * splits
    waves = -(-units // num_sms)
    per_unit = 2.0 * cfg.block_m * cfg.block_n * -(-k // splits) / (
        _PEAK_FLOPS / num_sms * _TILE_EFFICIENCY[(cfg.block_m, cfg.block_n)])
    seconds = max(waves * per_unit, (m * k + n * k + 2 * m * n) / dram_bytes_per_s)
    if splits > 1:
        seconds += (8 * splits + 2) * m * n / dram_bytes_per_s + 3e-6
    return seconds


def default_config(m: int, n: int, k: int, num_sms: int | None = None) -> Fp8Config:
    """The compiled tile and split with the least estimated time (ties: no split, the larger
    tile). Split-K is considered only where the tiles fill less than one wave."""
    num_sms = device.num_sms() if num_sms is None else num_sms
    best, best_key = None, None
    for tile in _FP8_TILES:
        if tile[3] > 1 and -(-m // tile[0]) < 2:
            continue  # a pair needs two row blocks
        tiles = -(-m // tile[0]) * -(-n // tile[1])
        for split in (1, 2, 4, 8) if tiles < num_sms else (1,):
            cfg = Fp8Config(*tile, split_k=split)
            if cfg.splits_for(k) != split:
                continue
            seconds = estimate_seconds(cfg, m, n, k, num_sms, device.dram_bytes_per_s())
            key = (round(seconds, 8), split, -tile[0] * tile[1], -tile[3])
            if best_key is None or key < best_key:
                best, best_key = cfg, key
    return best


# --------------------------------------------------------------------------------------
# quantize_fp8.


def _fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def _block_scales(amax, dtype):
    """fp32 scales for block maxima: amax / max finite, 1 where the block is all zeros."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax > 0, amax / _fp8_max(dtype), 1.0).astype(jnp.float32)


def _pad_to(x, axis: int, multiple: int):
    size = x.shape[axis]
    pad = -size % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _quantize(x, block, dtype):
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
    values = jnp.asarray(values).astype(jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    if block is not None and tuple(block) in ((1, SCALE_BLOCK), (SCALE_BLOCK, SCALE_BLOCK)):
        rows, cols = values.shape[-2:]
        s = jnp.swapaxes(scale, -1, -2)                          # [.., R or Rb, Cb]
        s = jnp.repeat(s, SCALE_BLOCK, axis=-1)[..., :cols]
        if tuple(block)[0] == SCALE_BLOCK:
            s = jnp.repeat(s, SCALE_BLOCK, axis=-2)[..., :rows, :]
        return values * s
    return values * scale


# --------------------------------------------------------------------------------------
# Scale forms: what an operand's scale means, relative to the operand as stored.


@dataclasses.dataclass(frozen=True)
class _Form:
    kind: str  # "scalar", "vector" (over the free dim), "block_row" (1 x 128), "block" (128 x 128)


def _classify(scale_shape, shape, contracting: int, name: str) -> _Form:
    """The form of a scale of `scale_shape` for an operand stored as `shape` ([R, C]) whose
    dimension `contracting` is K; ValueError when it is none of them."""
    rows, cols = shape
    cb, rb = -(-cols // SCALE_BLOCK), -(-rows // SCALE_BLOCK)
    scale_shape = tuple(scale_shape)
    if math.prod(scale_shape) == 1 and len(scale_shape) <= 2:
        return _Form("scalar")
    if contracting == 1 and scale_shape == (cb, rows):
        return _Form("block_row")
    if scale_shape == (cb, rb):
        return _Form("block")
    if contracting == 1 and scale_shape in ((rows, 1), (rows,)):
        return _Form("vector")
    if contracting == 0 and scale_shape in ((1, cols), (cols,)):
        return _Form("vector")
    raise ValueError(
        f"jax_tma.fp8_dot_general: {name}_scale of shape {scale_shape} is none of the forms "
        f"for an operand of shape {tuple(shape)} contracted over dimension {contracting}: a "
        f"scalar, (1, 128) blocks {(cb, rows)} (K last only), (128, 128) blocks {(cb, rb)}, or "
        f"a vector over the free dimension "
        f"{(rows, 1) if contracting == 1 else (1, cols)}")


def _canonical_scale(scale, form: _Form, shape, contracting: int, side: str):
    """The kernel's view of an operand's scale: ("block", [Kb, free] or [Kb, free blocks]),
    ("vector", [free]) or ("scalar", []), None for a form the kernel cannot take."""
    scale = jnp.asarray(scale, jnp.float32)
    free = shape[1 - contracting]
    if form.kind == "scalar":
        return "scalar", scale.reshape(())
    if form.kind == "vector":
        return "vector", scale.reshape(free)
    if form.kind == "block_row":
        # [Kb, free]: A's block scales as the kernel loads them; B's vary per column: no.
        return ("block", scale) if side == "a" else None
    s = scale if contracting == 1 else scale.T  # [Kb, free blocks]
    if side == "a":  # one scale per row and K slice
        return "block", jnp.repeat(s, SCALE_BLOCK, axis=1)[:, :free]
    return "block", s


def _expand_reference(scale, form: _Form, shape, contracting: int):
    """The scale expanded to broadcast against the operand (the XLA path), in fp32."""
    scale = jnp.asarray(scale, jnp.float32)
    rows, cols = shape
    if form.kind == "scalar":
        return scale.reshape(())
    if form.kind == "vector":
        return scale.reshape((rows, 1) if contracting == 1 else (1, cols))
    s = jnp.swapaxes(scale, 0, 1)                               # [R or Rb, Cb]
    s = jnp.repeat(s, SCALE_BLOCK, axis=1)[:, :cols]
    if form.kind == "block":
        s = jnp.repeat(s, SCALE_BLOCK, axis=0)[:rows]
    return s


# --------------------------------------------------------------------------------------
# The primitive: a [M, K] and b [N, K] FP8 (K-major), then where present sa [Kb, M] (block),
# sb [Kb, Nb] (block), row_scale ([] or [M]), col_scale ([] or [N]), bias [N]; out [M, N].

def _split(rest, has_sa, has_sb, row_scale, col_scale, has_bias):
    rest = list(rest)
    take = lambda present: rest.pop(0) if present else None  # noqa: E731
    return (take(has_sa), take(has_sb), take(row_scale != NONE), take(col_scale != NONE),
            take(has_bias))


def _abstract_eval(a, b, *rest, out_dtype, **params):
    del params
    return result_aval((a.shape[0], b.shape[0]), out_dtype, a, b, *rest)


def _reference(a, b, *rest, has_sa, has_sb, row_scale, col_scale, has_bias, out_dtype, config,
               local, promote):
    """What the kernel computes, in XLA: the dequantised operands' product in fp32, the
    epilogue's scales and bias, one rounding."""
    del config, local, promote
    sa, sb, rs, cs, bias = _split(rest, has_sa, has_sb, row_scale, col_scale, has_bias)
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    k = a.shape[1]
    if sa is not None:  # [Kb, M] -> [M, K]
        a32 = a32 * jnp.repeat(sa.T, SCALE_BLOCK, axis=1)[:, :k]
    if sb is not None:  # [Kb, Nb] -> [N, K]
        s = jnp.repeat(jnp.repeat(sb.T, SCALE_BLOCK, axis=0), SCALE_BLOCK, axis=1)
        b32 = b32 * s[: b.shape[0], :k]
    out = lax.dot_general(a32, b32, (((1,), (1,)), ((), ())),
                          precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if rs is not None:
        out = out * (rs[:, None] if rs.ndim else rs)
    if cs is not None:
        out = out * cs
    if bias is not None:
        out = out + bias
    return out.astype(out_dtype)


def kernel_enabled() -> bool:
    """Whether the FP8 kernel may run: yes unless ``JAX_TMA_FP8_KERNEL`` says no (then the fp8
    ops lower to XLA's reference of the same math: dequantise, fp32 dot). ``JAX_TMA_DISABLE``
    turns every kernel off, this one included."""
    return _ext.env_flag("JAX_TMA_FP8_KERNEL", default=True, on="to use the FP8 kernel",
                         off="to lower the FP8 ops to XLA's reference")


def kernel_applies(a, b, out_dtype, promote: bool = True) -> bool:
    """Whether the FP8 kernel computes a product of these operands (avals or arrays): one FP8
    type for both, bf16 or fp32 out, sizes in the kernel's range."""
    dtype = jnp.dtype(a.dtype)
    if dtype not in FP8_DTYPES or jnp.dtype(b.dtype) != dtype:
        return False
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        return False
    if not promote and (dtype != FP8_DTYPES[0] or jnp.dtype(out_dtype) != jnp.float32):
        return False
    m, k = a.shape
    n = b.shape[0]
    return min(m, n, k) >= 1 and max(m, n, k) < 2**30


def _kernel_call(a, b, *rest, has_sa, has_sb, row_scale, col_scale, has_bias, out_dtype,
                 config, promote=True, poison=False):
    """The FFI call: pads K to 16-byte rows, N to 8 and the block scales' rows to 16 bytes,
    runs the kernel (split-K: fp32 partial products summed here, the bias added after)."""
    sa, sb, rs, cs, bias = _split(rest, has_sa, has_sb, row_scale, col_scale, has_bias)
    m, k = a.shape
    n = b.shape[0]
    out_dtype = jnp.dtype(out_dtype)
    cfg = Fp8Config(*_UNPROMOTED_TILE) if not promote else (
        config if config is not None else default_config(m, n, k))
    a = _pad_to(a, 1, _K_MULTIPLE)
    b = _pad_to(_pad_to(b, 1, _K_MULTIPLE), 0, _N_MULTIPLE)
    n_pad = b.shape[0]
    if cs is not None and cs.ndim:
        cs = _pad_to(cs, 0, _N_MULTIPLE)
    if bias is not None:
        bias = _pad_to(bias, 0, _N_MULTIPLE)
    nb = -(-n_pad // SCALE_BLOCK)
    f32 = jnp.float32
    placeholder = jnp.zeros((1,), f32)
    sa = _pad_to(sa, 1, _SCALE_ROW_MULTIPLE) if sa is not None else placeholder
    if sb is not None and sb.shape[1] < nb:  # N padded past a block edge: scale never used
        sb = jnp.pad(sb, ((0, 0), (0, nb - sb.shape[1])))
    sb = _pad_to(sb, 1, _SCALE_ROW_MULTIPLE) if sb is not None else placeholder
    splits = cfg.splits_for(k)
    d_dtype = jnp.dtype(f32) if splits > 1 else out_dtype
    d_shape = (splits, m, n_pad)
    i64 = np.int64
    attrs = dict(
        block_m=i64(cfg.block_m), block_n=i64(cfg.block_n), stages=i64(cfg.stages),
        cluster_m=i64(cfg.cluster_m), promote=i64(promote), splits=i64(splits),
        m=i64(m), n=i64(n_pad), k=i64(a.shape[1]), batch=i64(1), a_batched=i64(0),
        b_batched=i64(0), sa_ld=i64(sa.shape[1] if has_sa else 4),
        sb_ld=i64(sb.shape[1] if has_sb else 4), has_sa=i64(has_sa), has_sb=i64(has_sb),
        row_scale=i64(_VECTOR_CODE[row_scale]), col_scale=i64(_VECTOR_CODE[col_scale]),
        has_bias=i64(has_bias and splits == 1))
    operands = (a, b, sa, sb, placeholder if rs is None else rs.reshape(-1),
                placeholder if cs is None else cs.reshape(-1),
                bias if bias is not None and splits == 1 else placeholder)
    out_type = jax.ShapeDtypeStruct(d_shape, d_dtype)
    d, = kernel_ffi_call(KERNEL_TARGET, (out_type,), operands, attrs, poison=poison)
    if splits > 1:
        d = sum_split_partials(d)
        if bias is not None:
            d = d + bias
        return d[:, :n].astype(out_dtype)
    return d[0, :, :n] if n_pad != n else d.reshape(m, n)


def _kernel_fn(avals_in, params):
    """The FP8 kernel's call, or None where the reference runs (XLA)."""
    if not (kernel_enabled() and kernel_applies(avals_in[0], avals_in[1], params["out_dtype"],
                                                 params["promote"])):
        return None
    return functools.partial(_kernel_call, **{k: v for k, v in params.items() if k != "local"})


def _partitioned(params):
    return functools.partial(fp8_sharding.partitioned_fp8_dot, local_op=_bind_local,
                             params=params)


def _batch_rule(args, dims, **params):
    """vmap: mapped axes of a, its block scales and row scales fold into M (one kernel); a
    mapped b side (b, its scales, column scales, bias) runs the reference, batched in XLA."""
    a, b, *rest = args
    a_dims, b_dims = dims[0], dims[1]
    sa, sb, rs, cs, bias = _split(rest, params["has_sa"], params["has_sb"],
                                  params["row_scale"], params["col_scale"], params["has_bias"])
    rest_dims = list(dims[2:])
    d_sa, d_sb, d_rs, d_cs, d_bias = _split(rest_dims, params["has_sa"],
                                            params["has_sb"], params["row_scale"],
                                            params["col_scale"], params["has_bias"])
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    b_side_mapped = any(d is not None for d in (b_dims, d_sb, d_cs, d_bias))
    if b_side_mapped:
        moved = [jnp.moveaxis(x, d, 0) if d is not None else
                 jnp.broadcast_to(x, (size, *x.shape)) for x, d in zip(args, dims)]
        return jax.vmap(functools.partial(_reference, **params))(*moved), 0

    def mapped(x, d):
        return jnp.moveaxis(x, d, 0) if d is not None else jnp.broadcast_to(x, (size, *x.shape))

    a = mapped(a, a_dims)
    m = a.shape[1]
    flat = [a.reshape(size * m, -1), b]
    if sa is not None:  # [size, Kb, M] -> [Kb, size * M]
        s = mapped(sa, d_sa)
        flat.append(jnp.moveaxis(s, 0, 1).reshape(s.shape[1], size * m))
    if sb is not None:
        flat.append(sb)
    row_scale = params["row_scale"]
    if rs is not None:
        if d_rs is None and row_scale == SCALAR:
            flat.append(rs)
        else:  # per-entry scalars or rows: one vector over the folded rows
            r = mapped(rs, d_rs)
            flat.append(jnp.broadcast_to(r.reshape(size, -1), (size, m)).reshape(size * m))
            row_scale = VECTOR
    flat += [x for x in (cs, bias) if x is not None]
    out = fp8_dot_p.bind(*flat, **{**params, "row_scale": row_scale})
    return out.reshape(size, m, -1), 0


fp8_dot_p = define_primitive("jax_tma_fp8_dot", abstract_eval=_abstract_eval,
                             reference=_reference, kernel_fn=_kernel_fn,
                             partitioned=_partitioned)
_bind_local = bind_local(fp8_dot_p)
batching.primitive_batchers[fp8_dot_p] = _batch_rule


# --------------------------------------------------------------------------------------
# Public ops.

DimensionNumbers = tuple


def _check_dims(lhs, rhs, dimension_numbers) -> tuple[int, int]:
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc = tuple(int(x) for x in lc), tuple(int(x) for x in rc)
    except (TypeError, ValueError):
        raise ValueError(f"jax_tma.fp8_dot_general: dimension_numbers must be "
                         f"((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), got "
                         f"{dimension_numbers!r}") from None
    if lhs.ndim != 2 or rhs.ndim != 2 or len(lc) != 1 or len(rc) != 1 or tuple(lb) or tuple(rb):
        raise ValueError(
            f"jax_tma.fp8_dot_general: takes 2-D operands with one contracting dimension each "
            f"and no batch dimensions (vmap for a batch), got shapes {lhs.shape}, {rhs.shape} "
            f"and dimension_numbers {dimension_numbers}")
    lc, rc = lc[0] % 2, rc[0] % 2
    if lhs.shape[lc] != rhs.shape[rc]:
        raise ValueError(f"jax_tma.fp8_dot_general: contracting dimensions differ: lhs "
                         f"{lhs.shape} dimension {lc}, rhs {rhs.shape} dimension {rc}")
    return lc, rc


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _fp8_dot(lhs, rhs, lhs_scale, rhs_scale, bias, dims, out_dtype, config, has_bias, promote):
    return _forward(lhs, rhs, lhs_scale, rhs_scale, bias, dims, out_dtype, config, has_bias,
                    promote)


def _forward(lhs, rhs, lhs_scale, rhs_scale, bias, dims, out_dtype, config, has_bias, promote):
    lc, rc = dims
    lform = _classify(jnp.shape(lhs_scale), lhs.shape, lc, "lhs")
    rform = _classify(jnp.shape(rhs_scale), rhs.shape, rc, "rhs")
    a_view = _canonical_scale(lhs_scale, lform, lhs.shape, lc, "a")
    b_view = _canonical_scale(rhs_scale, rform, rhs.shape, rc, "b")
    if a_view is None or b_view is None:  # scales the kernel cannot take: XLA
        a32 = lhs.astype(jnp.float32) * _expand_reference(lhs_scale, lform, lhs.shape, lc)
        b32 = rhs.astype(jnp.float32) * _expand_reference(rhs_scale, rform, rhs.shape, rc)
        out = lax.dot_general(a32, b32, (((lc,), (rc,)), ((), ())),
                              precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
        if has_bias:
            out = out + bias
        return out.astype(out_dtype)
    a = lhs if lc == 1 else lhs.T
    b = rhs if rc == 1 else rhs.T
    kinds = {"a": a_view[0], "b": b_view[0]}
    # Operand order: a, b, sa, sb, row_scale, col_scale, bias.
    ordered = [a, b]
    if kinds["a"] == "block":
        ordered.append(a_view[1])
    if kinds["b"] == "block":
        ordered.append(b_view[1])
    if kinds["a"] != "block":
        ordered.append(a_view[1])
    if kinds["b"] != "block":
        ordered.append(b_view[1])
    if has_bias:
        ordered.append(bias)
    return fp8_dot_p.bind(
        *ordered, has_sa=kinds["a"] == "block", has_sb=kinds["b"] == "block",
        row_scale=NONE if kinds["a"] == "block" else kinds["a"],
        col_scale=NONE if kinds["b"] == "block" else kinds["b"], has_bias=has_bias,
        out_dtype=jnp.dtype(out_dtype), config=config, local=False, promote=promote)


def _fp8_dot_fwd(lhs, rhs, lhs_scale, rhs_scale, bias, dims, out_dtype, config, has_bias,
                 promote):
    out = _forward(lhs, rhs, lhs_scale, rhs_scale, bias, dims, out_dtype, config, has_bias,
                   promote)
    return out, (lhs, rhs, lhs_scale, rhs_scale, bias)


def _fp8_dot_bwd(dims, out_dtype, config, has_bias, promote, saved, ct):
    """Straight-through: the cotangents of the dequantised operands, in bf16, through
    jax_tma.dot_general (the bf16 kernel on Hopper)."""
    del out_dtype, config, promote
    lhs, rhs, lhs_scale, rhs_scale, bias = saved
    lc, rc = dims
    bf16 = jnp.bfloat16
    lform = _classify(jnp.shape(lhs_scale), lhs.shape, lc, "lhs")
    rform = _classify(jnp.shape(rhs_scale), rhs.shape, rc, "rhs")
    lhs_deq = lhs.astype(jnp.float32) * _expand_reference(lhs_scale, lform, lhs.shape, lc)
    rhs_deq = rhs.astype(jnp.float32) * _expand_reference(rhs_scale, rform, rhs.shape, rc)
    lhs_deq, rhs_deq = lhs_deq.astype(bf16), rhs_deq.astype(bf16)
    g = ct.astype(bf16)  # [M, N]
    # d lhs[.., K..]: g [M, N] with rhs over N; laid out as lhs is stored.
    d_lhs = _bf16_dot_general(g, rhs_deq, (((1,), (1 - rc,)), ((), ())))  # [M, K]
    d_rhs = _bf16_dot_general(g, lhs_deq, (((0,), (1 - lc,)), ((), ())))  # [N, K]
    if lc == 0:
        d_lhs = d_lhs.T
    if rc == 0:
        d_rhs = d_rhs.T
    d_bias = jnp.sum(ct.astype(jnp.float32), axis=0).astype(bias.dtype) if has_bias else (
        jnp.zeros_like(bias))
    cts = (d_lhs, d_rhs, jnp.zeros_like(lhs_scale), jnp.zeros_like(rhs_scale), d_bias)
    return tuple(_aval.sum_to_varying(c, p) for c, p in zip(cts, saved))


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def _output_type(op: str, preferred_element_type, out_dtype):
    """The output dtype from lax's keyword and its alias: bf16 unless one names fp32."""
    if (preferred_element_type is not None and out_dtype is not None
            and jnp.dtype(preferred_element_type) != jnp.dtype(out_dtype)):
        raise ValueError(f"{op}: out_dtype is another name for preferred_element_type; got "
                         f"out_dtype={out_dtype!r} and "
                         f"preferred_element_type={preferred_element_type!r}")
    chosen = jnp.dtype(next((t for t in (preferred_element_type, out_dtype) if t is not None),
                            jnp.bfloat16))
    if chosen not in OUT_DTYPES:
        raise ValueError(f"{op}: preferred_element_type and its alias out_dtype must be "
                         f"bfloat16 or float32, got {chosen.name}")
    return chosen


def fp8_dot_general(lhs: Any, rhs: Any, lhs_scale: Any, rhs_scale: Any,
                    dimension_numbers=(((1,), (1,)), ((), ())), *, precision=None,
                    preferred_element_type: Any = None, out_dtype: Any = None,
                    bias: Any = None, config: Fp8Config | None = None) -> jax.Array:
    """``dot_general(lhs * lhs_scale, rhs * rhs_scale) + bias`` on FP8 operands.

    Args:
      lhs: [M, K] or [K, M], float8_e4m3fn or float8_e5m2.
      rhs: [N, K] (the default dimension numbers: weights stored K-major, as the kernel reads
        them) or [K, N].
      lhs_scale, rhs_scale: fp32 scales in one of the forms of the module docstring (per tensor,
        a vector over the free dimension, (1, 128) or (128, 128) blocks as quantize_fp8 writes
        them).
      dimension_numbers: ``(((lc,), (rc,)), ((), ()))``: one contracting dimension per operand.
      precision: as for ``lax.dot_general`` (validated there). Every precision gets the same
        accumulation: fp32, promoted out of the tensor core every 128 K, which is what
        ``Precision.HIGHEST`` asks of an FP8 dot.
      preferred_element_type: the output type, bf16 (default) or fp32.
      out_dtype: another name for preferred_element_type (both given: they must agree).
      bias: [N], added in fp32 before the rounding, or None.
      config: an ``Fp8Config`` among ``FP8_CONFIGS`` (by default a heuristic picks one).

    Returns:
      [M, N] in out_dtype. Accumulated in fp32 (on Hopper: promoted out of the tensor core
      every 128 K), rounded once.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if jnp.dtype(x.dtype) not in FP8_DTYPES:
            raise TypeError(f"jax_tma.fp8_dot_general: {name} must be float8_e4m3fn or "
                            f"float8_e5m2, got {x.dtype.name} (quantize with "
                            f"jax_tma.quantize_fp8)")
    out_dtype = _output_type("jax_tma.fp8_dot_general", preferred_element_type, out_dtype)
    canonicalize_precision(precision)  # lax's error for anything it does not accept
    if config is not None and not isinstance(config, Fp8Config):
        raise TypeError(f"jax_tma.fp8_dot_general: config must be an Fp8Config or None, got "
                        f"{config!r}")
    lc, rc = _check_dims(lhs, rhs, dimension_numbers)
    lhs_scale = jnp.asarray(lhs_scale, jnp.float32)
    rhs_scale = jnp.asarray(rhs_scale, jnp.float32)
    _classify(lhs_scale.shape, lhs.shape, lc, "lhs")
    _classify(rhs_scale.shape, rhs.shape, rc, "rhs")
    n = rhs.shape[1 - rc]
    has_bias = bias is not None
    if has_bias:
        bias = jnp.asarray(bias, jnp.float32)
        if bias.shape != (n,):
            raise ValueError(f"jax_tma.fp8_dot_general: bias must be [N] = [{n}], got shape "
                             f"{bias.shape}")
    else:
        bias = jnp.zeros((), jnp.float32)
    _ext.warn_if_unavailable()
    return _fp8_dot(lhs, rhs, lhs_scale, rhs_scale, bias, (lc, rc), jnp.dtype(out_dtype), config,
                    has_bias, True)


def fp8_matmul(a: Any, b: Any, a_scale: Any, b_scale: Any, *, precision=None,
               preferred_element_type: Any = None, out_dtype: Any = None, bias: Any = None,
               config: Fp8Config | None = None) -> jax.Array:
    """``(a * a_scale) @ (b * b_scale) + bias`` for FP8 a [..., M, K] and b [K, N].

    The leading dimensions of a (and of a_scale, which then has them too) fold into M. b is
    [K, N] as in ``jnp.matmul``; the kernel reads it K-major, so XLA transposes it first: store
    weights as [N, K] and call ``fp8_dot_general`` to skip that. Scale forms and the rest as
    for ``fp8_dot_general``.
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim < 2 or b.ndim != 2:
        raise ValueError(f"jax_tma.fp8_matmul: a must be [..., M, K] and b [K, N], got shapes "
                         f"{a.shape} and {b.shape}")
    dims = (((1,), (0,)), ((), ()))
    out_dtype = _output_type("jax_tma.fp8_matmul", preferred_element_type, out_dtype)
    f = functools.partial(fp8_dot_general, dimension_numbers=dims, precision=precision,
                          preferred_element_type=out_dtype, bias=bias, config=config)
    if a.ndim == 2:
        return f(a, b, a_scale, b_scale)
    a_scale = jnp.asarray(a_scale, jnp.float32)
    lead = a.shape[:-2]
    scale_lead = a_scale.ndim >= 2 and a_scale.shape[:len(lead)] == lead and (
        a_scale.ndim == a.ndim)
    fn = lambda x, s: f(x, b, s, b_scale)  # noqa: E731
    for _ in lead:
        fn = jax.vmap(fn, in_axes=(0, 0 if scale_lead else None))
    return fn(a, a_scale)


def fp8_unpromoted_matmul(a, b, a_scale, b_scale):
    """Test helper: the kernel compiled without promotion (e4m3, per-tensor scales, fp32 out),
    which accumulates the whole K inside the tensor core; XLA's reference elsewhere."""
    return fp8_dot_p.bind(a, b, jnp.asarray(a_scale, jnp.float32).reshape(()),
                          jnp.asarray(b_scale, jnp.float32).reshape(()), has_sa=False,
                          has_sb=False, row_scale=SCALAR, col_scale=SCALAR, has_bias=False,
                          out_dtype=jnp.dtype(jnp.float32), config=None, local=True,
                          promote=False)
