"""jax_tma.fp8_ragged_dot: results against a float64 reference on every path, errors, the
primitive's rules (vmap, sharding, export), the CUDA lowering, and the grouped FP8 kernel on a
Hopper GPU.

The reference dequantises with numpy alone: the FP8 bytes decoded through a table of all 256
codes (ml_dtypes), the scales expanded over their blocks by hand, the ragged product in float64.
Error bounds (Frobenius-norm relative error against it, random data): bf16 output 1e-2 (one
rounding); fp32 output 1e-5 through XLA (fp32 sums over K up to 1024) and 2e-3 from the kernel,
whose tensor core keeps about 14 bits of its FP8 sums within each 128-wide K slice (as
test_fp8.py's bounds). GPU tests poison the output (NaN) so that any element the kernel does not
write fails.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_tma
from jax_tma.ops.fp8 import config as fp8_config
from jax_tma.ops.fp8 import ragged_primitive as rp
from support import (cpu_mesh, cuda_hlo, equations, f64_ragged_contraction, f64_ragged_rows,
                     group_sizes, needs_extension, rel_error, target_calls)

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
XLA_TOL = {BF16: 1e-2, F32: 1e-5}
KERNEL_TOL = {BF16: 1e-2, F32: 2e-3}  # the tensor core's FP8 sums, promoted every 128 K
BLOCK = 128


def tol(out_dtype) -> float:
    """The bound for the op's default path: XLA's fp32 reference off the GPU, the FP8 kernel on a
    Hopper GPU with the extension."""
    on_kernel = jax.default_backend() == "gpu" and jax_tma.kernel_status().available
    return (KERNEL_TOL if on_kernel else XLA_TOL)[np.dtype(out_dtype)]


# ---------------------------------------------------------------- float64 reference


def decode(values) -> np.ndarray:
    """FP8 values in float64, decoded from their bytes through a table of the 256 codes."""
    values = np.asarray(values)
    table = np.arange(256, dtype=np.uint8).view(values.dtype).astype(np.float64)
    return table[values.view(np.uint8)]


def f64_dequantised(xq, wq, xs, ws) -> tuple[np.ndarray, np.ndarray]:
    """x * xs [M, K] and w * ws [G, N, K] in float64, decoded from the FP8 bytes; the scales as
    quantize_fp8 lays them out ((1, 128): [Kb, M]; (128, 128): [G, Kb, Nb]) or one value."""
    x, w = decode(xq), decode(wq)
    (m, k), (g, n, _) = x.shape, w.shape
    xs, ws = np.asarray(xs, np.float64), np.asarray(ws, np.float64)
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    if xs.shape == (kb, m):
        x = x * np.repeat(xs.T, BLOCK, axis=1)[:, :k]
    else:
        x = x * xs.reshape(())
    if ws.shape == (g, kb, nb):
        s = np.repeat(np.repeat(np.swapaxes(ws, 1, 2), BLOCK, axis=1), BLOCK, axis=2)
        w = w * s[:, :n, :k]
    else:
        w = w * ws.reshape(())
    return x, w


def f64_fp8_ragged(xq, wq, xs, ws, gs) -> np.ndarray:
    """ragged_dot of the dequantised x [M, K] and each group's w^T ([N, K] stored), float64."""
    return f64_ragged_rows(*f64_dequantised(xq, wq, xs, ws), gs, w_k_major=True)


def operands(rng, m, k, n, g, dtype=E4M3, blocks=(True, True)):
    """Quantised operands and their scales: block scales as quantize_fp8 writes them, or (where
    `blocks` says no) one scale per tensor. Rows and weights span several binades so that the
    block scales differ."""
    x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-2, 2, (m, 1)))
    w = rng.standard_normal((g, n, k)) * np.exp(rng.uniform(-2, 2, (g, 1, k)))
    xq, xs = jax_tma.quantize_fp8(x.astype(np.float32), (1, 128) if blocks[0] else None, dtype)
    wq, ws = jax_tma.quantize_fp8(w.astype(np.float32), (128, 128) if blocks[1] else None, dtype)
    return np.asarray(xq), np.asarray(wq), np.asarray(xs), np.asarray(ws)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


# ---------------------------------------------------------------- results (XLA path here)

CASES = [(200, 300, 200, 4, "ragged"), (77, 128, 64, 3, "short"),
         (130, 256, 136, 5, "empty_ends"), (1, 64, 8, 1, "one")]


def _case_sizes(pattern, m, g, rng):
    return np.array([1], np.int32) if pattern == "one" else group_sizes(pattern, m, g, rng)


@pytest.mark.parametrize("out_dtype", [BF16, F32])
@pytest.mark.parametrize("m,k,n,g,pattern", CASES)
def test_matches_float64(rng, m, k, n, g, pattern, out_dtype):
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = _case_sizes(pattern, m, g, rng)
    out = jax_tma.fp8_ragged_dot(xq, wq, xs, ws, gs, preferred_element_type=out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs)) <= tol(out_dtype)
    end = int(gs.sum())
    assert np.all(np.asarray(out)[end:] == 0)


@pytest.mark.parametrize("gs", [[-3, 10, 20], [5, -2, 30], [20, 20, 5]])
def test_sizes_are_clamped(rng, gs):
    """Negative sizes count as 0 and the groups past M are cut off, as the kernel reads them."""
    m, k, n = 40, 128, 16
    xq, wq, xs, ws = operands(rng, m, k, n, 3)
    gs = np.array(gs, np.int32)
    clamped = np.minimum(np.cumsum(np.maximum(gs, 0)), m)
    clamped = np.diff(clamped, prepend=0).astype(np.int32)
    out = jax_tma.fp8_ragged_dot(xq, wq, xs, ws, gs, preferred_element_type=F32)
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, clamped)) <= tol(F32)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint32])
def test_narrow_and_unsigned_sizes(rng, dtype):
    """Sizes of any integer type read as their values: clamping an int8 to M > 127 in its own
    type would wrap."""
    m, k, n = 200, 128, 16
    xq, wq, xs, ws = operands(rng, m, k, n, 2)
    gs = np.array([100, 100], dtype)
    out = jax_tma.fp8_ragged_dot(xq, wq, xs, ws, gs, preferred_element_type=F32)
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs.astype(np.int32))) <= tol(F32)
    ct = rng.standard_normal((m, n)).astype(BF16)
    dx, dw = _vjp(xq, wq, xs, ws, gs, ct)
    x64, w64 = f64_dequantised(xq, wq, xs, ws)
    assert rel_error(dx, f64_ragged_rows(np_quantise_rows(ct), w64, gs)) <= tol(BF16)
    assert rel_error(dw, f64_ragged_contraction(ct, x64, gs)) <= tol(BF16)


@pytest.mark.parametrize("blocks", [(False, False), (True, False), (False, True)])
def test_per_tensor_scales(rng, blocks):
    m, k, n, g = 96, 200, 72, 3
    xq, wq, xs, ws = operands(rng, m, k, n, g, blocks=blocks)
    gs = group_sizes("ragged", m, g, rng)
    out = jax_tma.fp8_ragged_dot(xq, wq, xs, ws, gs, preferred_element_type=F32)
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs)) <= tol(F32)
    # One value as a Python float or a [1, 1] array too.
    out1 = jax_tma.fp8_ragged_dot(xq, wq, 0.5 if not blocks[0] else xs,
                                  np.full((1, 1), 2.0, np.float32) if not blocks[1] else ws, gs,
                                  preferred_element_type=F32)
    want = f64_fp8_ragged(xq, wq, 0.5 if not blocks[0] else xs, 2.0 if not blocks[1] else ws,
                          gs)
    assert rel_error(out1, want) <= tol(F32)


def test_e5m2(rng):
    m, k, n, g = 64, 256, 128, 2
    xq, wq, xs, ws = operands(rng, m, k, n, g, E5M2)
    gs = group_sizes("ragged", m, g, rng)
    out = jax_tma.fp8_ragged_dot(xq, wq, xs, ws, gs)
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs)) <= tol(BF16)


def test_is_ragged_dot_of_the_dequantised_operands(rng):
    """The definition, in lax: ragged_dot of the dequantised fp32 operands, rhs as [G, K, N]."""
    m, k, n, g = 100, 384, 96, 4
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = group_sizes("ragged", m, g, rng)
    x = jax_tma.ops.fp8.quantize.dequantize_fp8(xq, xs, (1, 128))
    w = jax_tma.ops.fp8.quantize.dequantize_fp8(wq, ws, (128, 128))
    want = jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), jnp.asarray(gs),
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    out = jax_tma.fp8_ragged_dot(xq, wq, xs, ws, gs, preferred_element_type=F32)
    assert rel_error(out, want) <= tol(F32)


def test_jit_and_traced_group_sizes(rng):
    m, k, n, g = 48, 128, 32, 3
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = group_sizes("short", m, g, rng)
    out = jax.jit(jax_tma.fp8_ragged_dot)(xq, wq, xs, ws, jnp.asarray(gs))
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs)) <= tol(BF16)


# ---------------------------------------------------------------- errors


def _args(m=8, k=256, n=16, g=2, dtype=E4M3):
    return (np.zeros((m, k), dtype), np.zeros((g, n, k), dtype),
            np.ones((2, m), np.float32), np.ones((g, 2, 1), np.float32),
            np.full((g,), m // g, np.int32))


@pytest.mark.parametrize("change,error,message", [
    (dict(lhs=np.zeros((8, 256), BF16)), TypeError, "lhs must be float8_e4m3fn or float8_e5m2, "
                                                    "got bfloat16"),
    (dict(rhs=np.zeros((2, 16, 256), np.float32)), TypeError, "rhs must be float8"),
    (dict(rhs=np.zeros((2, 16, 256), E5M2)), TypeError,
     "share one FP8 type, got float8_e4m3fn and float8_e5m2"),
    (dict(rhs=np.zeros((2, 16, 128), E4M3)), ValueError,
     r"got shapes \(8, 256\) and \(2, 16, 128\)"),
    (dict(rhs=np.zeros((16, 256), E4M3)), ValueError, r"rhs \[G, N, K\]"),
    (dict(group_sizes=np.ones((3,), np.int32)), ValueError,
     r"group_sizes must be \[G\] with G = rhs.shape\[0\] = 2, got shape \(3,\)"),
    (dict(group_sizes=np.ones((2,), np.float32)), TypeError, "group_sizes must be integers"),
    (dict(lhs_scale=np.ones((8, 2), np.float32)), ValueError,
     r"lhs_scale of shape \(8, 2\) is neither one value nor the block scales of lhs "
     r"\(8, 256\) \(1 x 128 blocks\): expected \(2, 8\)"),
    (dict(rhs_scale=np.ones((2, 1), np.float32)), ValueError,
     r"rhs_scale of shape \(2, 1\) .* expected \(2, 2, 1\)"),
    (dict(rhs_scale=np.ones((2, 2, 1), np.int32)), TypeError, "rhs_scale must be a float array"),
])
def test_errors_name_shapes_and_dtypes(change, error, message):
    names = ("lhs", "rhs", "lhs_scale", "rhs_scale", "group_sizes")
    args = dict(zip(names, _args()))
    args.update(change)
    with pytest.raises(error, match=message):
        jax_tma.fp8_ragged_dot(*(args[n] for n in names))


def test_errors_output_type_and_config():
    args = _args()
    with pytest.raises(ValueError, match="preferred_element_type must be bfloat16 or float32, "
                                         "got float16"):
        jax_tma.fp8_ragged_dot(*args, preferred_element_type=jnp.float16)
    with pytest.raises(ValueError, match="not compiled for FP8 ragged products"):
        jax_tma.fp8_ragged_dot(*args, config=jax_tma.Fp8Config(128, 128, 5, 1))
    with pytest.raises(TypeError, match="config must be a jax_tma.Fp8Config"):
        jax_tma.fp8_ragged_dot(*args, config=jax_tma.GemmConfig())
    for cfg in jax_tma.FP8_RAGGED_CONFIGS:  # every compiled one is accepted
        jax_tma.fp8_ragged_dot(*args, config=cfg)


# ---------------------------------------------------------------- gradients


def np_quantise_rows(y, dtype=E4M3):
    """y [M, N] quantised per row and 128 columns in numpy, as DeepSeek-V3 scales activations:
    scale = block amax / the type's largest finite value (1 for an all-zero block), values
    rounded to nearest even; returned dequantised, in float64."""
    y = np.asarray(y, np.float32)
    m, n = y.shape
    nb = -(-n // BLOCK)
    padded = np.zeros((m, nb * BLOCK), np.float32)
    padded[:, :n] = y
    blocks = padded.reshape(m, nb, BLOCK)
    amax = np.abs(blocks).max(axis=2)
    scale = np.where(amax > 0, amax / np.float32(ml_dtypes.finfo(dtype).max), 1).astype(np.float32)
    values = (blocks / scale[:, :, None]).astype(dtype)
    return (values.astype(np.float64) * scale[:, :, None]).reshape(m, -1)[:, :n]


def _vjp(xq, wq, xs, ws, gs, ct):
    fn = functools.partial(jax_tma.fp8_ragged_dot, lhs_scale=xs, rhs_scale=ws, group_sizes=gs)
    return jax.vjp(lambda a, b: fn(a, b), jnp.asarray(xq), jnp.asarray(wq))[1](jnp.asarray(ct))


GRAD_CASES = [(200, 300, 136, 4, "ragged"), (96, 256, 128, 3, "short"),
              (130, 128, 72, 5, "empty_ends")]


@pytest.mark.parametrize("blocks", [(True, True), (False, False)])
@pytest.mark.parametrize("m,k,n,g,pattern", GRAD_CASES)
def test_gradients_match_float64(rng, m, k, n, g, pattern, blocks):
    """dx: dy quantised per 1 x 128 (in numpy here) against the dequantised weights, read
    transposed; dW: dy against the dequantised rows, per group. Both bf16, the dequantised
    operands' cotangents; rows past the last group give nothing and get zero."""
    xq, wq, xs, ws = operands(rng, m, k, n, g, blocks=blocks)
    gs = group_sizes(pattern, m, g, rng)
    ct = rng.standard_normal((m, n)).astype(BF16)
    dx, dw = _vjp(xq, wq, xs, ws, gs, ct)
    assert dx.dtype == BF16 and dx.shape == (m, k) and dw.dtype == BF16 and dw.shape == (g, n, k)
    x64, w64 = f64_dequantised(xq, wq, xs, ws)
    want_dx = f64_ragged_rows(np_quantise_rows(ct), w64, gs)  # w [G, N, K] read as [G, K, N]^T
    assert rel_error(dx, want_dx) <= tol(BF16)
    assert rel_error(dw, f64_ragged_contraction(ct, x64, gs)) <= tol(BF16)
    used = int(np.sum(gs))
    assert not np.any(np.asarray(dx[used:], np.float32))
    # FP8 dy loses ~2 % (e4m3's 3 mantissa bits): dx is the exact gradient up to that.
    assert rel_error(dx, f64_ragged_rows(ct, w64, gs)) <= 0.05


def test_gradients_of_e5m2_operands(rng):
    """e5m2 (XLA's path): dy quantised in e5m2 too, the same recipe."""
    m, k, n, g = 96, 256, 128, 3
    xq, wq, xs, ws = operands(rng, m, k, n, g, dtype=E5M2)
    gs = group_sizes("short", m, g, rng)
    ct = rng.standard_normal((m, n)).astype(BF16)
    dx, dw = _vjp(xq, wq, xs, ws, gs, ct)
    x64, w64 = f64_dequantised(xq, wq, xs, ws)
    assert rel_error(dx, f64_ragged_rows(np_quantise_rows(ct, E5M2), w64, gs)) <= tol(BF16)
    assert rel_error(dw, f64_ragged_contraction(ct, x64, gs)) <= tol(BF16)


def test_gradients_of_sizes_past_the_rows(rng):
    """Sizes summing past M and negative ones are clamped as the forward pass reads them."""
    m, k, n, g = 64, 128, 64, 3
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = np.array([40, -5, 50], np.int32)
    clamped = np.array([40, 0, 24], np.int32)
    ct = rng.standard_normal((m, n)).astype(BF16)
    dx, dw = _vjp(xq, wq, xs, ws, gs, ct)
    x64, w64 = f64_dequantised(xq, wq, xs, ws)
    assert rel_error(dx, f64_ragged_rows(np_quantise_rows(ct), w64, clamped)) <= tol(BF16)
    assert rel_error(dw, f64_ragged_contraction(ct, x64, clamped)) <= tol(BF16)


def test_grad_through_quantize_fp8_reaches_the_float_operands(rng):
    """quantize_fp8 -> fp8_ragged_dot differentiates end to end (quantisation straight through):
    jax.grad gives x's and w's gradients in their own types, and the scales none."""
    m, k, n, g = 96, 256, 128, 3
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, n, k)) * 0.05, jnp.float32)
    gs = np.array([30, 0, 50], np.int32)
    ct = rng.standard_normal((m, n)).astype(np.float32)

    def loss(x, w):
        xq, xs = jax_tma.quantize_fp8(x, (1, 128))
        wq, ws = jax_tma.quantize_fp8(w, (128, 128))
        y = jax_tma.fp8_ragged_dot(xq, wq, xs, ws, gs, preferred_element_type=F32)
        return jnp.sum(y * ct)

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    xq, xs = jax_tma.quantize_fp8(x, (1, 128))
    wq, ws = jax_tma.quantize_fp8(w, (128, 128))
    x64, w64 = f64_dequantised(xq, wq, xs, ws)
    assert rel_error(dx, f64_ragged_rows(np_quantise_rows(ct), w64, gs)) <= tol(BF16)
    assert rel_error(dw, f64_ragged_contraction(ct.astype(BF16), x64, gs)) <= tol(BF16)


def test_vmap_of_gradients_matches_a_loop(rng):
    m, k, n, g = 64, 128, 64, 2
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = np.array([20, 30], np.int32)
    cts = rng.standard_normal((3, m, n)).astype(BF16)
    fn = functools.partial(jax_tma.fp8_ragged_dot, lhs_scale=xs, rhs_scale=ws, group_sizes=gs)
    _, pullback = jax.vjp(lambda a, b: fn(a, b), jnp.asarray(xq), jnp.asarray(wq))
    dxs, dws = jax.vmap(pullback)(jnp.asarray(cts))
    for i in range(3):
        dx, dw = pullback(jnp.asarray(cts[i]))
        np.testing.assert_array_equal(np.asarray(dxs[i], np.float32), np.asarray(dx, np.float32))
        assert rel_error(dws[i], dw) <= 1e-2


def test_second_order_raises_a_clear_error(rng):
    xq, wq, xs, ws = operands(rng, 16, 128, 16, 2)
    gs = np.array([10, 6], np.int32)
    x = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)

    def loss(x):
        q, s = jax_tma.quantize_fp8(x, (1, 128))
        return jnp.sum(jax_tma.fp8_ragged_dot(q, wq, s, ws, gs).astype(jnp.float32) ** 2)

    with pytest.raises(NotImplementedError, match="only first-order reverse-mode"):
        jax.grad(lambda x: jnp.sum(jax.grad(loss)(x)))(x)


def test_forward_mode_raises_a_clear_error(rng):
    xq, wq, xs, ws = operands(rng, 16, 128, 16, 2)
    gs = np.array([10, 6], np.int32)
    fn = functools.partial(jax_tma.fp8_ragged_dot, lhs_scale=xs, rhs_scale=ws, group_sizes=gs)
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda a: fn(a, jnp.asarray(wq)), (jnp.asarray(xq),), (jnp.asarray(xq),))


# ---------------------------------------------------------------- the primitive's rules


def test_vmap_matches_a_loop(rng):
    v, m, k, n, g = 3, 40, 200, 48, 3
    ops = [operands(rng, m, k, n, g) for _ in range(v)]
    xq, wq, xs, ws = (np.stack([o[i] for o in ops]) for i in range(4))
    gs = np.stack([group_sizes("ragged", m, g, rng) for _ in range(v)])
    # shared weights and their scales
    out = jax.vmap(jax_tma.fp8_ragged_dot, in_axes=(0, None, 0, None, 0))(xq, wq[0], xs, ws[0],
                                                                         gs)
    for i in range(v):
        assert rel_error(out[i], f64_fp8_ragged(xq[i], wq[0], xs[i], ws[0], gs[i])) <= tol(BF16)
    # everything mapped
    out = jax.vmap(jax_tma.fp8_ragged_dot)(xq, wq, xs, ws, gs)
    for i in range(v):
        assert rel_error(out[i], f64_fp8_ragged(xq[i], wq[i], xs[i], ws[i], gs[i])) <= tol(BF16)
    # weights shared, their block scales mapped (both join the batch); shared group sizes
    out = jax.vmap(jax_tma.fp8_ragged_dot, in_axes=(0, None, 0, 0, None))(xq, wq[0], xs, ws,
                                                                         gs[0])
    for i in range(v):
        assert rel_error(out[i], f64_fp8_ragged(xq[i], wq[0], xs[i], ws[i], gs[0])) <= tol(BF16)


def test_vmap_of_per_tensor_scales(rng):
    """One value per mapped entry: folded as block scales of that value (one primitive)."""
    v, m, k, n, g = 2, 24, 136, 40, 2
    xq, wq, _, ws = operands(rng, m, k, n, g, blocks=(False, True))
    sa = np.array([0.5, 3.0], np.float32)
    sb = np.array([2.0, 0.25], np.float32)
    gs = group_sizes("short", m, g, rng)
    fn = jax.vmap(lambda a, b: jax_tma.fp8_ragged_dot(xq, wq, a, b, gs,
                                                      preferred_element_type=F32))
    out = fn(sa, sb)
    for i in range(v):
        assert rel_error(out[i], f64_fp8_ragged(xq, wq, sa[i], sb[i], gs)) <= tol(F32)
    jaxpr = jax.make_jaxpr(fn)(sa, sb)
    eqns = equations(jaxpr.jaxpr, rp.fp8_ragged_dot_p)
    assert len(eqns) == 1 and eqns[0].params["sa_block"] and eqns[0].params["sb_block"]
    del ws


def test_vmap_with_shared_weights_is_one_primitive_without_copies():
    f32 = np.float32
    args = (_spec((4, 64, 256), E4M3), _spec((8, 32, 256), E4M3), _spec((4, 2, 64), f32),
            _spec((8, 2, 1), f32), _spec((8,), np.int32))
    jaxpr = jax.make_jaxpr(jax.vmap(jax_tma.fp8_ragged_dot, in_axes=(0, None, 0, None, None)))(
        *args)
    eqns = equations(jaxpr.jaxpr, rp.fp8_ragged_dot_p)
    assert len(eqns) == 1
    shapes = [v.aval.shape for v in eqns[0].invars]
    assert shapes == [(4, 64, 256), (1, 8, 32, 256), (1, 8), (4, 2, 64), (1, 8, 2, 1)]


@pytest.mark.parametrize("x_spec,s_spec", [(P("x", None), P(None, "x")),
                                           (P("x", None), P()), (P(), P(None, "x")),
                                           (P(("x", "y"), None), P(None, ("x", "y")))])
def test_sharded_tokens_match_float64(rng, x_spec, s_spec):
    """Tokens (and their scales) sharded run per device with local group sizes; the experts'
    weights are replicated."""
    mesh = cpu_mesh((4, 2), ("x", "y"))
    m, k, n, g = 64, 256, 48, 5
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = group_sizes("ragged", m, g, rng)
    put = lambda a, s: jax.device_put(jnp.asarray(a), NamedSharding(mesh, s))  # noqa: E731
    out = jax.jit(jax_tma.fp8_ragged_dot)(put(xq, x_spec), put(wq, P()), put(xs, s_spec),
                                          put(ws, P()), jnp.asarray(gs))
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs)) <= tol(BF16)


@pytest.mark.parametrize("blocks", [(False, False), (True, False), (False, True)])
def test_sharded_with_per_tensor_scales(rng, blocks):
    mesh = cpu_mesh((8,), ("x",))
    m, k, n, g = 64, 200, 40, 3
    xq, wq, xs, ws = operands(rng, m, k, n, g, blocks=blocks)
    gs = group_sizes("ragged", m, g, rng)
    xs_spec = P(None, "x") if blocks[0] else P()
    put = lambda a, s: jax.device_put(jnp.asarray(a), NamedSharding(mesh, s))  # noqa: E731
    out = jax.jit(jax_tma.fp8_ragged_dot)(put(xq, P("x", None)), wq, put(xs, xs_spec), ws,
                                          jnp.asarray(gs))
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs)) <= tol(BF16)


def test_sharded_weights_are_gathered(rng):
    """A weight sharded along N or K (which the kernel never splits) still gives the product."""
    mesh = cpu_mesh((2, 4), ("x", "y"))
    m, k, n, g = 32, 512, 64, 2
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = group_sizes("ragged", m, g, rng)
    put = lambda a, s: jax.device_put(jnp.asarray(a), NamedSharding(mesh, s))  # noqa: E731
    out = jax.jit(jax_tma.fp8_ragged_dot)(put(xq, P()), put(wq, P(None, "x", "y")), xs, ws,
                                          jnp.asarray(gs))
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs)) <= tol(BF16)


def test_export_cpu_round_trip(rng):
    """Without the extension too: exported for cpu, the primitive's local lowering."""
    m, k, n, g = 24, 136, 16, 2
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = group_sizes("short", m, g, rng)
    exported = jax.export.export(jax.jit(jax_tma.fp8_ragged_dot), platforms=("cpu",))(
        *(_spec(a.shape, a.dtype) for a in (xq, wq, xs, ws, gs)))
    cpu = jax.devices("cpu")[0]
    out = jax.export.deserialize(exported.serialize()).call(
        *(jax.device_put(a, cpu) for a in (xq, wq, xs, ws, gs)))
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs)) <= tol(BF16)


@needs_extension
def test_export_for_cuda_holds_the_kernel():
    """jax_tma.export_disabled_checks() covers the FP8 grouped target: the module holds one call."""
    assert f"custom_call:{rp.KERNEL_TARGET}" in {str(c) for c in jax_tma.export_disabled_checks()}
    exported = jax.export.export(jax.jit(jax_tma.fp8_ragged_dot), platforms=("cuda",),
                                 disabled_checks=jax_tma.export_disabled_checks())(
        *_lowering_args())
    assert exported.mlir_module().count(f"custom_call @{rp.KERNEL_TARGET}(") == 1


# ---------------------------------------------------------------- CUDA lowering (no GPU)


def _lowering_args(dtype=E4M3, m=4096, k=2048, n=1536, g=8):
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    return (_spec((m, k), dtype), _spec((g, n, k), dtype), _spec((kb, m), F32),
            _spec((g, kb, nb), F32), _spec((g,), np.int32))


@needs_extension
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_cuda_lowering_calls_the_kernel_once(out_dtype):
    fn = functools.partial(jax_tma.fp8_ragged_dot, preferred_element_type=out_dtype)
    hlo = cuda_hlo(fn, *_lowering_args())
    assert target_calls(hlo, rp.KERNEL_TARGET) == 1
    assert target_calls(hlo, "jax_tma_ragged_dot_sm90") == 0
    # per-tensor scales: the same kernel
    args = _lowering_args()
    hlo = cuda_hlo(fn, args[0], args[1], _spec((), F32), _spec((), F32), args[4])
    assert target_calls(hlo, rp.KERNEL_TARGET) == 1


@needs_extension
def test_cuda_lowering_of_the_gradients():
    """Differentiated through quantize_fp8: the forward and dx products on the FP8 grouped
    kernel, dW on the bf16 grouped kernel (contraction form), nothing else."""
    m, k, n, g = 4096, 2048, 1536, 8

    def loss(x, w, gs):
        xq, xs = jax_tma.quantize_fp8(x, (1, 128))
        wq, ws = jax_tma.quantize_fp8(w, (128, 128))
        return jnp.sum(jax_tma.fp8_ragged_dot(xq, wq, xs, ws, gs).astype(jnp.float32))

    hlo = cuda_hlo(jax.value_and_grad(loss, argnums=(0, 1)), _spec((m, k), BF16),
                   _spec((g, n, k), BF16), _spec((g,), np.int32))
    assert target_calls(hlo, rp.KERNEL_TARGET) == 2
    assert target_calls(hlo, "jax_tma_ragged_dot_sm90") == 1


@needs_extension
def test_cuda_lowering_e5m2_runs_xla():
    hlo = cuda_hlo(jax_tma.fp8_ragged_dot, *_lowering_args(E5M2))
    assert target_calls(hlo, rp.KERNEL_TARGET) == 0


@needs_extension
def test_cuda_lowering_vmap_is_one_kernel():
    m, k, n, g = 512, 256, 128, 8
    args = (_spec((4, m, k), E4M3), _spec((g, n, k), E4M3), _spec((4, 2, m), F32),
            _spec((g, 2, 1), F32), _spec((4, g), np.int32))
    hlo = cuda_hlo(jax.vmap(jax_tma.fp8_ragged_dot, in_axes=(0, None, 0, None, 0)), *args)
    assert target_calls(hlo, rp.KERNEL_TARGET) == 1


@needs_extension
def test_cuda_lowering_of_a_config(rng):
    """A given config reaches the call's attributes; the heuristic picks a compiled one."""
    for cfg in fp8_config.FP8_RAGGED_CONFIGS:
        hlo = cuda_hlo(functools.partial(jax_tma.fp8_ragged_dot, config=cfg), *_lowering_args())
        assert f"block_m = {cfg.block_m} : i64" in hlo and f"block_n = {cfg.block_n} : i64" in hlo
    for rows, groups in ((64, 8), (8192, 8), (16384, 128), (32768, 4)):
        cfg = fp8_config.default_ragged_config(rows, 2048, 7168, groups, num_sms=132)
        assert cfg in fp8_config.FP8_RAGGED_CONFIGS
    # What the H200 sweep found fastest (TFLOP/s): the 128 x 192 pairs for 32768 rows in 4
    # groups (1311 against 1259 for the 128 x 256 pairs) and for 128 groups of 128 rows (717
    # against 705); the 128 x 256 pairs for 1024 rows in 4 groups (949 against 761).
    pick = functools.partial(fp8_config.default_ragged_config, num_sms=132)
    assert pick(32768, 7168, 4096, 4).tile == (128, 192, 4, 2)
    assert pick(16384, 1536, 2048, 128).tile == (128, 192, 4, 2)
    assert pick(1024, 7168, 4096, 4).tile == (128, 256, 3, 2)
    del rng


# ---------------------------------------------------------------- the kernel (Hopper GPU)


def _run_kernel(xq, wq, xs, ws, gs, out_dtype, config, sa_block=True, sb_block=True):
    """The kernel's result over a NaN-poisoned buffer, through the primitive's plan."""
    x, w, g = jnp.asarray(xq)[None], jnp.asarray(wq)[None], jnp.asarray(gs)[None]
    sa = jnp.asarray(xs, jnp.float32)
    sb = jnp.asarray(ws, jnp.float32)
    sa = sa[None] if sa_block else sa.reshape(())
    sb = sb[None] if sb_block else sb.reshape(())
    plan = rp.kernel_plan(x, w, g, out_dtype)
    assert plan is not None
    fn = jax.jit(functools.partial(rp._kernel_call, plan=plan, sa_block=sa_block,
                                   sb_block=sb_block, out_dtype=out_dtype, config=config,
                                   poison=True))
    out = np.asarray(fn(x, w, g, sa, sb), np.float32)[0]
    assert not np.isnan(out).any(), "kernel left poisoned (unwritten) outputs"
    return out


CONFIG_IDS = ["x".join(map(str, c.tile)) for c in fp8_config.FP8_RAGGED_CONFIGS]


@pytest.mark.gpu
@pytest.mark.parametrize("config", fp8_config.FP8_RAGGED_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("out_dtype", [BF16, F32])
@pytest.mark.parametrize("pattern", ["ragged", "short", "empty_ends"])
def test_kernel_matches_float64(rng, pattern, out_dtype, config):
    """Every compiled tile and output type: groups not multiples of the tile, empty groups,
    sizes summing to less than M (rows past them zero), K and N not multiples of 128."""
    m, k, n, g = 1000, 1000, 328, 7
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = group_sizes(pattern, m, g, rng)
    out = _run_kernel(xq, wq, xs, ws, gs, out_dtype, config)
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs)) <= KERNEL_TOL[out_dtype]
    assert np.all(out[int(gs.sum()):] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("config", fp8_config.FP8_RAGGED_CONFIGS, ids=CONFIG_IDS)
def test_kernel_groups_start_at_any_row(rng, config):
    """Groups whose first rows fall at every offset mod 4 (A's scales are loaded from the
    4-aligned row before a tile's first: TMA's innermost coordinate must fall on 16 bytes), with
    row scales that differ per row, so that a scale read one row off fails the bound."""
    m, k, n, g = 700, 384, 136, 8
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = np.array([1, 2, 3, 130, 131, 65, 66, 300], np.int32)
    assert sorted(set(np.cumsum(gs)[:-1] % 4)) == [0, 1, 2, 3]
    out = _run_kernel(xq, wq, xs, ws, gs, F32, config)
    want = f64_fp8_ragged(xq, wq, xs, ws, gs)
    assert rel_error(out, want) <= KERNEL_TOL[F32]
    # Row by row too: one norm over rows whose scales differ by up to e^4 would let a small
    # group's scales, read one row off, pass under the large rows.
    end = int(gs.sum())
    per_row = (np.linalg.norm(out[:end] - want[:end], axis=1)
               / np.linalg.norm(want[:end], axis=1))
    assert per_row.max() <= 1e-2, int(per_row.argmax())
    assert np.all(out[end:] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("config", fp8_config.FP8_RAGGED_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("blocks", [(False, False), (True, False), (False, True)])
def test_kernel_per_tensor_scales(rng, blocks, config):
    m, k, n, g = 300, 384, 256, 4
    xq, wq, xs, ws = operands(rng, m, k, n, g, blocks=blocks)
    gs = group_sizes("ragged", m, g, rng)
    out = _run_kernel(xq, wq, xs, ws, gs, F32, config, *blocks)
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs)) <= KERNEL_TOL[F32]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,g", [(1, 16, 8, 1), (5, 200, 24, 3), (129, 128, 1000, 2),
                                     (4096, 7168, 256, 32)])
def test_kernel_edge_sizes_match_float64(rng, m, k, n, g):
    """One row; K of 16 (one partial slice); N padded to 8 (1000: a ragged last column block);
    many groups of a few row blocks each."""
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = group_sizes("short", m, g, rng) if m > 1 else np.array([1], np.int32)
    out = _run_kernel(xq, wq, xs, ws, gs, BF16, None)
    assert rel_error(out, f64_fp8_ragged(xq, wq, xs, ws, gs)) <= KERNEL_TOL[BF16]
    assert np.all(out[int(gs.sum()):] == 0)


@pytest.mark.gpu
def test_kernel_vmap_matches_float64(rng):
    """The batch folded into one kernel: per-entry group sizes and weights."""
    v, m, k, n, g = 3, 257, 512, 192, 4
    ops = [operands(rng, m, k, n, g) for _ in range(v)]
    xq, wq, xs, ws = (np.stack([o[i] for o in ops]) for i in range(4))
    gs = np.stack([group_sizes("ragged", m, g, rng) for _ in range(v)])
    for in_axes, pick in (((0, None, 0, None, 0), lambda i: 0), ((0, 0, 0, 0, 0), lambda i: i)):
        out = jax.jit(jax.vmap(jax_tma.fp8_ragged_dot, in_axes=in_axes))(
            xq, wq if pick(1) else wq[0], xs, ws if pick(1) else ws[0], gs)
        for i in range(v):
            want = f64_fp8_ragged(xq[i], wq[pick(i)], xs[i], ws[pick(i)], gs[i])
            assert rel_error(out[i], want) <= tol(BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("config", fp8_config.FP8_RAGGED_CONFIGS, ids=CONFIG_IDS)
def test_kernel_is_deterministic(rng, config):
    m, k, n, g = 2000, 1024, 384, 16
    xq, wq, xs, ws = operands(rng, m, k, n, g)
    gs = jnp.asarray(group_sizes("ragged", m, g, rng))
    fn = jax.jit(functools.partial(jax_tma.fp8_ragged_dot, config=config))
    first = np.asarray(fn(xq, wq, xs, ws, gs))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(fn(xq, wq, xs, ws, gs)), first)


@pytest.mark.gpu
@pytest.mark.parametrize("change,message", [
    (dict(sa_ld=60), "sa_ld >= batch x rows and sb_ld >= ceil"),
    (dict(block_m=128, block_n=128, stages=5, cluster_m=1), "no compiled configuration with "
                                                            "block_m=128, block_n=128"),
    (dict(k=120), "k must be a multiple of 16 and n of 8"),
])
def test_handler_errors_name_the_sizes(change, message):
    """The FFI handler's own checks (reached only by a wrong call of the target)."""
    m, n, g = 64, 64, 2
    k = change.get("k", 128)
    x, w = jnp.zeros((1, m, k), E4M3), jnp.zeros((g, n, k), E4M3)
    gs = jnp.full((1, g), m // g, jnp.int32)
    sa, sb, one = jnp.ones((1, m), F32), jnp.ones((g, 1, 4), F32), jnp.ones((1,), F32)
    i64 = np.int64
    attrs = dict(block_m=i64(64), block_n=i64(128), stages=i64(7), cluster_m=i64(1),
                 rows=i64(m), n=i64(n), k=i64(k), groups=i64(g), batch=i64(1),
                 weights_batched=i64(0), group_sizes_batched=i64(0), sa_ld=i64(m), sb_ld=i64(4),
                 has_sa=i64(1), has_sb=i64(1), row_scale=i64(0), col_scale=i64(0))
    attrs.update({key: i64(v) for key, v in change.items()})
    out_types = (jax.ShapeDtypeStruct((1, m, n), BF16),
                 jax.ShapeDtypeStruct((rp.workspace_bytes("rows", g, 1),), jnp.uint8))
    call = jax.ffi.ffi_call(rp.KERNEL_TARGET, out_types)
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **attrs))(x, w, gs, sa, sb, one, one))
