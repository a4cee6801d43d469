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

``fp8_dot_general(lhs, rhs, lhs_scale, rhs_scale, dimension_numbers)`` computes ``dot_general(lhs *
lhs_scale, rhs * rhs_scale)`` (the scales broadcast or block-expanded as above) for 2-D FP8
operands, in fp32, rounded once to ``out_dtype`` (bf16 or fp32), plus an optional fp32 bias over
the output's columns. On Hopper it runs the sm90 FP8 kernel (csrc/contract/sm90_fp8.h): e4m3 or
e5m2 wgmma, the tensor core's partial sums promoted to fp32 registers every 128 K with the block
scales, per-tensor / row / column scales and the bias in the epilogue. ``precision`` picks the
accumulation as lax spells it: None, HIGH and HIGHEST promote every 128 K (the tensor core keeps
about 14 bits of its FP8 sums, so a long K accumulated inside it loses accuracy: at K = 16384,
1.3e-4 relative error promoted against 3e-3 not); ``DEFAULT`` and
``DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM`` accumulate the whole K in the tensor core (what
XLA's default FP8 dot does), faster, for per-tensor, row and column scales; block scales always
promote, and so do products of 128 rows or fewer (faster there). The kernel reads both operands
K-major: an operand stored with K first ([K, M] or [K, N]) is transposed by XLA first. Scale forms
per operand, tried in this order (the first whose shape matches wins): per tensor (one element);
(1, 128) blocks along K (operands stored with K last); (128, 128) blocks; a vector over the
operand's free dimension ([R, 1] when K is the columns, [1, C] when K is the rows). Scales that
vary along K within a block of 128 are not accepted. Both operands of one FP8 type run the kernel;
other combinations compute the same in XLA (dequantise, fp32 dot), as does every other platform.

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
from jax import lax
from jax._src.lax.lax import canonicalize_precision

from jax_tma import _ext
from jax_tma._core import aval as _aval
from jax_tma._core.keywords import preferred_type
from jax_tma.ops.fp8.config import (FP8_DTYPES, FP8_FAST_CONFIGS, OUT_DTYPES, SCALE_BLOCK,
                                    Fp8Config)
from jax_tma.ops.fp8 import autotune as fp8_tuning
from jax_tma.ops.fp8.primitive import NONE, fp8_dot_p
from jax_tma.ops.fp8.quantize import widen_fp8
from jax_tma.ops.gemm.api import dot_general as _bf16_dot_general


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


def _dequantised(values, scale, form: _Form, contracting: int):
    """``values * scale`` in fp32 (the XLA path and the gradients), the scale expanded to
    broadcast against the operand as stored."""
    scale = jnp.asarray(scale, jnp.float32)
    rows, cols = values.shape
    if form.kind == "scalar":
        s = scale.reshape(())
    elif form.kind == "vector":
        s = scale.reshape((rows, 1) if contracting == 1 else (1, cols))
    else:
        s = jnp.swapaxes(scale, 0, 1)                           # [R or Rb, Cb]
        s = jnp.repeat(s, SCALE_BLOCK, axis=1)[:, :cols]
        if form.kind == "block":
            s = jnp.repeat(s, SCALE_BLOCK, axis=0)[:rows]
    return widen_fp8(values) * s


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
        a32 = _dequantised(lhs, lhs_scale, lform, lc)
        b32 = _dequantised(rhs, rhs_scale, rform, rc)
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
    params = dict(has_sa=kinds["a"] == "block", has_sb=kinds["b"] == "block",
                  row_scale=NONE if kinds["a"] == "block" else kinds["a"],
                  col_scale=NONE if kinds["b"] == "block" else kinds["b"], has_bias=has_bias,
                  out_dtype=jnp.dtype(out_dtype), config=config, local=False, promote=promote)
    fp8_tuning.tune_missing(ordered, params)
    return fp8_dot_p.bind(*ordered, **params)


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
    lhs_deq = _dequantised(lhs, lhs_scale, lform, lc)
    rhs_deq = _dequantised(rhs, rhs_scale, rform, rc)
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


_FAST_PRECISIONS = ((lax.Precision.DEFAULT, lax.Precision.DEFAULT),
                    lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM)
# Products of fewer rows than this promote even where fast accumulation is allowed: the fast
# kernels have no 64-row tile, and the promoted ones are the faster there (docs/fp8.md).
FAST_MIN_ROWS = 129
_FAST_TILES = frozenset(c.tile for c in FP8_FAST_CONFIGS)


def _fast_accumulation(precision) -> bool:
    """Whether `precision` (lax's spellings; lax's error for any it does not accept) lets the
    tensor core accumulate the whole K: DEFAULT or the FAST_ACCUM preset, not None."""
    return canonicalize_precision(precision) in _FAST_PRECISIONS


def _output_type(op: str, preferred_element_type, out_dtype):
    """The output dtype from lax's keyword and its alias: bf16 unless one names fp32."""
    chosen = preferred_type(op, preferred_element_type, out_dtype)
    chosen = jnp.dtype(jnp.bfloat16 if chosen is None else chosen)
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
      precision: as for ``lax.dot_general``. None (the default), HIGH and HIGHEST: fp32 sums
        promoted out of the tensor core every 128 K, which is what HIGHEST asks of an FP8 dot
        (the default because it is the accurate one). ``Precision.DEFAULT`` or
        ``DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM``: the tensor core accumulates the
        whole K (XLA's default for FP8; faster, about 14 bits kept), where both scales are per
        tensor, row or column; with block scales it promotes anyway, and with 128 rows or
        fewer too unless `config` is a fast tile (the promoted kernel's 64-row tiles are
        faster there).
      preferred_element_type: the output type, bf16 (default) or fp32.
      out_dtype: another name for preferred_element_type (both given: they must agree).
      bias: [N], added in fp32 before the rounding, or None.
      config: an ``Fp8Config`` among ``FP8_CONFIGS`` (by default a heuristic picks one); with
        fast accumulation one among ``FP8_FAST_CONFIGS``.

    Returns:
      [M, N] in out_dtype. Accumulated in fp32 (on Hopper: promoted out of the tensor core
      every 128 K, or as `precision` allows), rounded once.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if jnp.dtype(x.dtype) not in FP8_DTYPES:
            raise TypeError(f"jax_tma.fp8_dot_general: {name} must be float8_e4m3fn or "
                            f"float8_e5m2, got {x.dtype.name} (quantize with "
                            f"jax_tma.quantize_fp8)")
    out_dtype = _output_type("jax_tma.fp8_dot_general", preferred_element_type, out_dtype)
    fast = _fast_accumulation(precision)
    config = Fp8Config.coerce(config, "jax_tma.fp8_dot_general")
    lc, rc = _check_dims(lhs, rhs, dimension_numbers)
    lhs_scale = jnp.asarray(lhs_scale, jnp.float32)
    rhs_scale = jnp.asarray(rhs_scale, jnp.float32)
    blocks = {_classify(lhs_scale.shape, lhs.shape, lc, "lhs").kind,
              _classify(rhs_scale.shape, rhs.shape, rc, "rhs").kind} & {"block", "block_row"}
    m = lhs.shape[1 - lc]
    fast = fast and not blocks and (m >= FAST_MIN_ROWS or (
        config is not None and config.tile in _FAST_TILES))
    if fast and config is not None and config.tile not in _FAST_TILES:
        raise ValueError(
            f"jax_tma.fp8_dot_general: fast accumulation (precision={precision!r}) is compiled "
            f"for the tiles of {', '.join(c.describe() for c in FP8_FAST_CONFIGS)} only, got "
            f"config={config.describe()}")
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
                    has_bias, not fast)


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
