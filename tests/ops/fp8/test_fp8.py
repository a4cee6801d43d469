"""jax_tma.quantize_fp8 / fp8_dot_general / fp8_matmul: quantisation layouts and round trips,
products against float64 references of the dequantised operands, errors, vmap, gradients,
sharding, the CUDA lowering, and the FP8 kernels on a Hopper GPU.

References are float64 products of the dequantised operands (values * scales), so only the
product's own error is measured. Bounds (Frobenius-norm relative error): fp32 output 2e-3
(block-scaled e4m3 at K = 8192, the issue's bound; the kernel promotes to fp32 every 128 K),
bf16 output 1e-2 (its rounding alone is ~2e-3); the XLA path (CPU) is an fp32 product: 1e-5.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_tma
from jax_tma._core.config import stream_k_variants
from jax_tma.ops.fp8 import api as fp8_api
from jax_tma.ops.fp8 import config as fp8_config
from jax_tma.ops.fp8 import primitive as fp8
from jax_tma.ops.fp8 import quantize as fp8_quantize
from support import cpu_mesh, cuda_hlo, needs_extension, random_array, rel_error

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
# Quantisation error of one value: half an ulp of 3 (e4m3) or 2 (e5m2) mantissa bits.
QUANT_TOL = {E4M3: 0.04, E5M2: 0.08}
OUT_TOL = {F32: 2e-3, BF16: 1e-2}
XLA_TOL = {F32: 1e-5, BF16: 1e-2}


def _tol(out_dtype) -> float:
    """The bound for a product of the ops' default path: XLA's fp32 reference off the GPU, the
    FP8 kernel (promoted every 128 K, fp32 sums in another order) on a Hopper GPU."""
    on_kernel = jax.default_backend() == "gpu" and jax_tma.kernel_status().available
    return (OUT_TOL if on_kernel else XLA_TOL)[np.dtype(out_dtype)]


@pytest.fixture(autouse=True)
def fp8_kernel(monkeypatch):
    """Every test runs with the FP8 kernel allowed (the default), whatever the caller's
    environment says; the opt-out has its own test."""
    monkeypatch.delenv("JAX_TMA_FP8_KERNEL", raising=False)


def test_kernel_switch(monkeypatch):
    assert fp8.kernel_enabled()
    for value, enabled in (("1", True), ("on", True), ("0", False), ("off", False),
                           ("False", False)):
        monkeypatch.setenv("JAX_TMA_FP8_KERNEL", value)
        assert fp8.kernel_enabled() is enabled
    monkeypatch.setenv("JAX_TMA_FP8_KERNEL", "maybe")
    with pytest.raises(ValueError, match="JAX_TMA_FP8_KERNEL='maybe'"):
        fp8.kernel_enabled()


def _f64(values, scale, block):
    """values * scale in float64 (exact: an FP8 value times an fp32 scale), the scales expanded
    by hand from quantize_fp8's documented layouts, for values [..., R, C]:
    None, (1, None), (None, 1): the scale broadcasts (shape (), [..., R, 1], [..., 1, C]);
    (1, 128): scale [..., ceil(C / 128), R], element [r, c] scaled by scale[c // 128, r];
    (128, 128): scale [..., ceil(C / 128), ceil(R / 128)], by scale[c // 128, r // 128]."""
    v = np.asarray(values).astype(np.float64)
    s = np.asarray(scale).astype(np.float64)
    block = None if block is None else tuple(block)
    if block not in ((1, 128), (128, 128)):
        return v * s
    rows, cols = v.shape[-2:]
    col_block = np.arange(cols)[None, :] // 128
    row = np.arange(rows)[:, None] // block[0]
    assert s.shape == (*v.shape[:-2], -(-cols // 128), -(-rows // block[0])), (s.shape, v.shape)
    return v * s[..., col_block, row]


@pytest.mark.parametrize("block", [None, (1, None), (None, 1), (1, 128), (128, 128)], ids=str)
def test_reference_dequantisation_follows_the_documented_layouts(rng, block):
    """_f64 against an element-by-element loop over the layouts above (leading dims, partial
    blocks on both axes), on scales that differ in every block."""
    lead, rows, cols = 2, 130, 260
    values = rng.standard_normal((lead, rows, cols)).astype(E4M3)
    shape = {None: (), (1, None): (lead, rows, 1), (None, 1): (lead, 1, cols),
             (1, 128): (lead, 3, rows), (128, 128): (lead, 3, 2)}[block]
    scale = rng.uniform(0.5, 2.0, size=shape).astype(F32)

    def scale_of(i, r, c):
        if block is None:
            return scale[()]
        if block == (1, None):
            return scale[i, r, 0]
        if block == (None, 1):
            return scale[i, 0, c]
        if block == (1, 128):
            return scale[i, c // 128, r]
        return scale[i, c // 128, r // 128]

    want = np.empty((lead, rows, cols))
    for i in range(lead):
        for r in range(rows):
            for c in range(cols):
                want[i, r, c] = float(values[i, r, c]) * float(scale_of(i, r, c))
    assert np.array_equal(_f64(values, scale, block), want)


def _data(rng, shape, spread=True):
    """Normal values whose rows differ in magnitude (so per-row and block scales matter)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if spread:
        x *= np.exp(rng.uniform(-3, 3, size=(*shape[:-1], 1))).astype(np.float32)
    return x


# ---------------------------------------------------------------- quantize_fp8 (CPU)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("block", fp8_quantize.BLOCKS, ids=str)
def test_quantize_round_trip_and_layout(rng, block, dtype):
    x = _data(rng, (200, 300))
    values, scale = jax_tma.quantize_fp8(x, block, dtype)
    assert values.dtype == dtype and values.shape == x.shape and scale.dtype == F32
    expected = {None: (), (1, None): (200, 1), (None, 1): (1, 300), (1, 128): (3, 200),
                (128, 128): (3, 2)}[block]
    assert scale.shape == expected
    assert np.isfinite(np.asarray(values, np.float32)).all()
    assert rel_error(_f64(values, scale, block), x) <= QUANT_TOL[dtype]


def test_quantize_block_scales_are_block_maxima(rng):
    x = _data(rng, (130, 260))
    _, s = jax_tma.quantize_fp8(x, (1, 128))
    want = np.abs(x[5, 128:256]).max() / 448.0
    np.testing.assert_allclose(np.asarray(s)[1, 5], want, rtol=1e-6)
    _, s = jax_tma.quantize_fp8(x, (128, 128))
    np.testing.assert_allclose(np.asarray(s)[2, 1], np.abs(x[128:, 256:]).max() / 448.0,
                               rtol=1e-6)


def test_quantize_zero_blocks_and_leading_dims(rng):
    x = np.zeros((2, 4, 256), np.float32)
    x[1, :, :128] = rng.standard_normal((4, 128))
    values, scale = jax_tma.quantize_fp8(x, (1, 128))
    assert scale.shape == (2, 2, 4)
    assert np.all(np.asarray(scale)[0] == 1.0) and np.all(np.asarray(values, np.float32)[0] == 0)
    np.testing.assert_allclose(_f64(values, scale, (1, 128)), x, rtol=0.07, atol=1e-6)


def test_quantize_errors():
    x = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="block must be one of"):
        jax_tma.quantize_fp8(x, (64, 64))
    with pytest.raises(ValueError, match="dtype must be float8"):
        jax_tma.quantize_fp8(x, None, jnp.bfloat16)
    with pytest.raises(TypeError, match="float array"):
        jax_tma.quantize_fp8(np.ones((4, 4), np.int32))
    with pytest.raises(ValueError, match="rank >= 2"):
        jax_tma.quantize_fp8(np.ones(4, np.float32), (1, 128))


def test_quantize_is_one_jit(rng):
    """quantize_fp8 traces to XLA ops only (no host work): it runs under jit."""
    x = _data(rng, (256, 384))
    v1, s1 = jax.jit(lambda x: jax_tma.quantize_fp8(x, (1, 128)))(x)
    v2, s2 = jax_tma.quantize_fp8(x, (1, 128))
    assert np.array_equal(np.asarray(v1, np.float32), np.asarray(v2, np.float32))
    assert np.array_equal(s1, s2)


# ---------------------------------------------------------------- products (CPU: XLA path)

# (lhs block, rhs block, lhs contracting dim, rhs contracting dim)
SCALE_CASES = [
    ((1, 128), (128, 128), 1, 1),   # DeepSeek-V3: activations 1x128, weights [N, K] 128x128
    (None, None, 1, 1),             # per tensor
    ((1, None), (1, None), 1, 1),   # per row of x, per row of w [N, K] (= per output column)
    (None, (None, 1), 1, 0),        # per tensor, weights [K, N] per column
    ((1, 128), None, 1, 0),         # block activations, per-tensor weights [K, N]
    ((128, 128), (128, 128), 0, 0),  # both stored K-first, 128x128
]


def _operands(rng, case, m, n, k, dtype=E4M3):
    lb, rb, lc, rc = case
    x = _data(rng, (m, k))
    w = _data(rng, (n, k), spread=False) / np.sqrt(k)
    lhs = x if lc == 1 else x.T
    rhs = w if rc == 1 else w.T
    a, sa = jax_tma.quantize_fp8(lhs, lb, dtype)
    b, sb = jax_tma.quantize_fp8(rhs, rb, dtype)
    ref_l, ref_r = _f64(a, sa, lb), _f64(b, sb, rb)
    ref = (ref_l if lc == 1 else ref_l.T) @ (ref_r if rc == 1 else ref_r.T).T
    return (a, b, sa, sb, (((lc,), (rc,)), ((), ()))), ref


@pytest.mark.parametrize("out_dtype", [F32, BF16])
@pytest.mark.parametrize("case", SCALE_CASES, ids=str)
def test_fp8_dot_general_matches_float64(rng, case, out_dtype):
    (a, b, sa, sb, dims), ref = _operands(rng, case, 40, 72, 300)
    bias = rng.standard_normal(72).astype(np.float32)
    out = jax_tma.fp8_dot_general(a, b, sa, sb, dims, out_dtype=out_dtype, bias=bias)
    assert out.dtype == out_dtype and out.shape == (40, 72)
    assert rel_error(out, ref + bias) <= _tol(out_dtype)


def test_fp8_matmul_leading_dims_and_e5m2(rng):
    x = _data(rng, (2, 3, 8, 256))
    w = rng.standard_normal((256, 24)).astype(np.float32)
    a, sa = jax_tma.quantize_fp8(x, (1, 128), E5M2)
    b, sb = jax_tma.quantize_fp8(w, (None, 1), E5M2)
    out = jax_tma.fp8_matmul(a, b, sa, sb, out_dtype=jnp.float32)
    assert out.shape == (2, 3, 8, 24)
    ref = np.einsum("ijmk,kn->ijmn", _f64(a, sa, (1, 128)), _f64(b, sb, (None, 1)))
    assert rel_error(out, ref) <= _tol(F32)
    a1, s1 = jax_tma.quantize_fp8(x, None, E5M2)  # one scale for every entry
    out = jax_tma.fp8_matmul(a1, b, s1, sb, out_dtype=jnp.float32)
    ref = np.einsum("ijmk,kn->ijmn", _f64(a1, s1, None), _f64(b, sb, (None, 1)))
    assert rel_error(out, ref) <= _tol(F32)


def test_fp8_errors(rng):
    a, sa = jax_tma.quantize_fp8(_data(rng, (16, 256)), (1, 128))
    b, sb = jax_tma.quantize_fp8(_data(rng, (32, 256)), (128, 128))
    with pytest.raises(TypeError, match="lhs must be float8"):
        jax_tma.fp8_dot_general(np.ones((16, 256), np.float32), b, 1.0, sb)
    with pytest.raises(ValueError, match=r"rhs_scale of shape \(5,\) is none of the forms"):
        jax_tma.fp8_dot_general(a, b, sa, np.ones(5, np.float32))
    with pytest.raises(ValueError, match="contracting dimensions differ"):
        jax_tma.fp8_dot_general(a, b, sa, sb, (((1,), (0,)), ((), ())))
    with pytest.raises(ValueError, match="2-D operands"):
        jax_tma.fp8_dot_general(a[None], b, sa, sb)
    with pytest.raises(ValueError, match="bias must be"):
        jax_tma.fp8_dot_general(a, b, sa, sb, bias=np.ones(7, np.float32))
    with pytest.raises(ValueError, match="out_dtype must be"):
        jax_tma.fp8_dot_general(a, b, sa, sb, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match="not a compiled FP8 tile"):
        jax_tma.Fp8Config(128, 64, 3, 1)


def test_fp8_mixed_types_run_through_xla(rng):
    (a, b, sa, sb, dims), ref = _operands(rng, SCALE_CASES[0], 16, 32, 256)
    b5 = jnp.asarray(b).astype(E5M2)
    ref = _f64(a, sa, (1, 128)) @ _f64(b5, sb, (128, 128)).T
    out = jax_tma.fp8_dot_general(a, b5, sa, sb, dims, out_dtype=jnp.float32)
    assert rel_error(out, ref) <= _tol(F32)


# ---------------------------------------------------------------- vmap, grad (CPU)


def test_vmap_folds_rows_and_maps_weights(rng):
    x = _data(rng, (3, 10, 256))
    a, sa = jax_tma.quantize_fp8(x, (1, 128))
    b, sb = jax_tma.quantize_fp8(_data(rng, (24, 256), spread=False), (128, 128))
    out = jax.vmap(lambda a, s: jax_tma.fp8_dot_general(a, b, s, sb, out_dtype=jnp.float32))(a, sa)
    wref = _f64(b, sb, (128, 128))
    for i in range(3):
        assert rel_error(out[i], _f64(a[i], sa[i], (1, 128)) @ wref.T) <= _tol(F32)
    bs, sbs = jax_tma.quantize_fp8(_data(rng, (2, 24, 256)), (128, 128))
    out = jax.vmap(lambda b, s: jax_tma.fp8_dot_general(a[0], b, sa[0], s,
                                                        out_dtype=jnp.float32))(bs, sbs)
    assert rel_error(out[1], _f64(a[0], sa[0], (1, 128)) @ _f64(bs[1], sbs[1], (128, 128)).T) \
        <= _tol(F32)


def test_straight_through_gradients(rng):
    x = _data(rng, (16, 256), spread=False)
    w = rng.standard_normal((256, 32)).astype(np.float32) / 16
    bias = rng.standard_normal(32).astype(np.float32)
    dy = rng.standard_normal((16, 32)).astype(np.float32)

    def f(x, w, bias):
        a, sa = jax_tma.quantize_fp8(x, (1, 128))
        b, sb = jax_tma.quantize_fp8(w, (128, 128))
        return jax_tma.fp8_matmul(a, b, sa, sb, out_dtype=jnp.float32, bias=bias)

    _, vjp = jax.vjp(f, x, w, bias)
    dx, dw, db = vjp(jnp.asarray(dy))
    assert dx.dtype == F32 and dw.dtype == F32
    # The bf16 gradient of x @ w at the dequantised operands.
    xq = _f64(*jax_tma.quantize_fp8(x, (1, 128)), (1, 128))
    wq = _f64(*jax_tma.quantize_fp8(w, (128, 128)), (128, 128))
    assert rel_error(dx, dy @ wq.T) <= 1.5e-2
    assert rel_error(dw, xq.T @ dy) <= 1.5e-2
    assert rel_error(db, dy.sum(0)) <= 1e-6


# ---------------------------------------------------------------- sharding (8 CPU devices)


@pytest.mark.parametrize("a_spec,b_spec", [(P("x", None), P()), (P(), P("x", None)),
                                           (P("x", "y"), P(None, "y")), (P(None, "x"), P(None, "x"))])
def test_sharded_matches_unsharded(rng, a_spec, b_spec):
    mesh = cpu_mesh((4, 2), ("x", "y"))
    (a, b, sa, sb, dims), ref = _operands(rng, SCALE_CASES[0], 64, 512, 1024)
    bias = rng.standard_normal(512).astype(np.float32)
    a_s = jax.device_put(jnp.asarray(a), NamedSharding(mesh, a_spec))
    b_s = jax.device_put(jnp.asarray(b), NamedSharding(mesh, b_spec))
    out = jax.jit(lambda a, b, sa, sb: jax_tma.fp8_dot_general(
        a, b, sa, sb, out_dtype=jnp.float32, bias=bias))(a_s, b_s, sa, sb)
    assert rel_error(out, ref + bias) <= _tol(F32)


# ---------------------------------------------------------------- CUDA lowering (no GPU)


def _calls(hlo: str) -> dict:
    found = re.findall(r"@(jax_tma_\w+)\(", hlo) + re.findall(r'custom_call_target="(jax_tma_\w+)"', hlo)
    return {name: found.count(name) for name in set(found)}


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@needs_extension
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.smoke
def test_cuda_lowering_is_one_kernel(dtype):
    m, n, k = 4096, 2048, 1024
    a, b = _spec((m, k), dtype), _spec((n, k), dtype)
    sa, sb = _spec((k // 128, m), F32), _spec((k // 128, n // 128), F32)
    f = lambda a, b, sa, sb: jax_tma.fp8_dot_general(a, b, sa, sb)  # noqa: E731
    hlo = cuda_hlo(f, a, b, sa, sb)
    assert _calls(hlo) == {fp8.KERNEL_TARGET: 1}
    assert "stablehlo.transpose" not in hlo and "stablehlo.pad" not in hlo
    # vmap over activations: rows folded into one call.
    g = jax.vmap(f, in_axes=(0, None, 0, None))
    hlo = cuda_hlo(g, _spec((3, m, k), dtype), b, _spec((3, k // 128, m), F32), sb)
    assert _calls(hlo) == {fp8.KERNEL_TARGET: 1}
    # Per-tensor scales: no block-scale operands at all, still one kernel.
    hlo = cuda_hlo(lambda a, b: jax_tma.fp8_dot_general(a, b, 2.0, 0.5), a, b)
    assert _calls(hlo) == {fp8.KERNEL_TARGET: 1}


@needs_extension
def test_cuda_lowering_opt_out_is_xla(monkeypatch):
    monkeypatch.setenv("JAX_TMA_FP8_KERNEL", "0")
    a, b = _spec((256, 512), E4M3), _spec((384, 512), E4M3)
    hlo = cuda_hlo(lambda a, b: jax_tma.fp8_dot_general(a, b, 2.0, 0.5), a, b)
    assert _calls(hlo) == {} and "stablehlo.dot_general" in hlo


@needs_extension
def test_cuda_lowering_falls_back_for_mixed_types_and_grads_use_the_bf16_kernel():
    a, b = _spec((256, 512), E4M3), _spec((256, 512), E5M2)
    hlo = cuda_hlo(lambda a, b: jax_tma.fp8_dot_general(a, b, 1.0, 1.0), a, b)
    assert fp8.KERNEL_TARGET not in hlo
    x, w = _spec((512, 1024), BF16), _spec((1024, 768), BF16)

    def loss(x, w):
        a, sa = jax_tma.quantize_fp8(x, (1, 128))
        b, sb = jax_tma.quantize_fp8(w, (128, 128))
        return jnp.sum(jax_tma.fp8_matmul(a, b, sa, sb).astype(F32) ** 2)

    hlo = cuda_hlo(jax.grad(loss, (0, 1)), x, w)
    assert _calls(hlo) == {fp8.KERNEL_TARGET: 1, "jax_tma_gemm_sm90": 2}


# ---------------------------------------------------------------- the FP8 kernels (GPU)


def _kernel(a, b, *rest, poison=True, **params):
    """The kernel's output written over a NaN-poisoned buffer."""
    params = dict(dict(has_sa=False, has_sb=False, row_scale=fp8.NONE, col_scale=fp8.NONE,
                       has_bias=False, out_dtype=F32, config=None, promote=True), **params)
    assert fp8.kernel_applies(a, b, params["out_dtype"])
    fn = jax.jit(functools.partial(fp8._kernel_call, poison=poison, **params))
    out = np.asarray(fn(a, b, *rest), np.float64)
    assert not np.isnan(out).any(), "kernel left poisoned (unwritten) outputs"
    return out


def _block_operands(rng, m, n, k, dtype=E4M3):
    x = _data(rng, (m, k))
    w = _data(rng, (n, k)) / np.sqrt(k)
    a, sa = jax_tma.quantize_fp8(x, (1, 128), dtype)
    b, sb = jax_tma.quantize_fp8(w, (128, 128), dtype)
    ref = _f64(a, sa, (1, 128)) @ _f64(b, sb, (128, 128)).T
    return a, b, sa, sb, ref


def _config_id(c):
    return "x".join(map(str, c.tile)) + (f"s{c.split_k}" if c.split_k > 1 else "")


GPU_CONFIGS = [*fp8_config.FP8_CONFIGS, fp8_config.Fp8Config(128, 128, 5, 1, split_k=3)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=_config_id)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_kernel_block_scaled_matches_float64(rng, config, dtype, out_dtype):
    m, n, k = 1000, 776, 1040  # ragged M, N and K tails of every tile
    a, b, sa, sb, ref = _block_operands(rng, m, n, k, dtype)
    bias = rng.standard_normal(n).astype(np.float32)
    out = _kernel(a, b, sa, sb, bias, has_sa=True, has_sb=True, has_bias=True,
                  out_dtype=out_dtype, config=config)
    assert rel_error(out, ref + bias) <= OUT_TOL[out_dtype]


# Promoted tiles whose width neither divides nor is a multiple of B's 128-column scale blocks
# (192, 144): their tiles span two blocks, split at one of lcm(width, 128) / width offsets.
SPLIT_CONFIGS = [c for c in fp8_config.FP8_CONFIGS
                 if fp8_config.SCALE_BLOCK % c.block_n and c.block_n % fp8_config.SCALE_BLOCK]


@pytest.mark.gpu
@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=_config_id)
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_kernel_block_scaled_every_split(rng, config, out_dtype):
    """Every offset into a scale block that the tile's columns start at (144: 0, 16, .., 112),
    the last tile cut by N inside the second block it spans; distinct column-block scales."""
    period = np.lcm(config.block_n, fp8_config.SCALE_BLOCK)
    m, n, k = 264, int(period) - 56, 1040
    assert period // config.block_n == -(-n // config.block_n)  # one tile per offset
    a, b, sa, sb, ref = _block_operands(rng, m, n, k)
    out = _kernel(a, b, sa, sb, has_sa=True, has_sb=True, out_dtype=out_dtype, config=config)
    assert rel_error(out, ref) <= OUT_TOL[out_dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SCALE_CASES, ids=str)
def test_kernel_scale_forms_match_float64(rng, case):
    (a, b, sa, sb, dims), ref = _operands(rng, case, 520, 392, 768)
    out = jax.jit(lambda a, b, sa, sb: jax_tma.fp8_dot_general(
        a, b, sa, sb, dims, out_dtype=jnp.float32))(a, b, sa, sb)
    assert rel_error(out, ref) <= OUT_TOL[F32]


@pytest.mark.gpu
def test_kernel_k8192_block_scaled_within_2e3_and_promotion_matters(rng):
    """The issue's bound, and what promotion buys: the same per-tensor product accumulated
    inside the tensor core over the whole K (precision=DEFAULT, the fast kernel) errs more."""
    m, n, k = 512, 512, 8192
    a, b, sa, sb, ref = _block_operands(rng, m, n, k)
    out = _kernel(a, b, sa, sb, has_sa=True, has_sb=True, out_dtype=F32)
    err_block = rel_error(out, ref)
    assert err_block <= 2e-3, err_block
    x = rng.standard_normal((m, k)).astype(np.float32) + 0.5  # a mean: long, growing sums
    w = rng.standard_normal((n, k)).astype(np.float32) + 0.5
    a, s_a = jax_tma.quantize_fp8(x)
    b, s_b = jax_tma.quantize_fp8(w)
    ref = _f64(a, s_a, None) @ _f64(b, s_b, None).T
    product = jax.jit(lambda a, b, precision: jax_tma.fp8_dot_general(
        a, b, s_a, s_b, precision=precision, out_dtype=jnp.float32), static_argnums=2)
    promoted = np.asarray(product(a, b, None), np.float64)
    unpromoted = np.asarray(product(a, b, "default"), np.float64)
    err_p, err_u = rel_error(promoted, ref), rel_error(unpromoted, ref)
    print(f"K=8192 relative error: block-scaled {err_block:.2e}, per-tensor promoted "
          f"{err_p:.2e}, unpromoted {err_u:.2e}")
    assert err_p <= 2e-3
    assert err_u > 2 * err_p, (err_u, err_p)


@pytest.mark.gpu
@pytest.mark.parametrize("config", fp8_config.FP8_FAST_CONFIGS, ids=_config_id)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_kernel_fast_accumulation_matches_float64(rng, config, dtype, out_dtype):
    """The tensor core's accumulation (promote=0) with per-tensor, row and column scales and a
    bias, on every fast tile, ragged tails. K = 1040 keeps the tensor core's rounding of its
    sums within the fp32 bound."""
    m, n, k = 1000, 776, 1040
    x, w = _data(rng, (m, k)), _data(rng, (n, k)) / np.sqrt(k)
    a, s_a = jax_tma.quantize_fp8(x, (1, None), dtype)
    b, s_b = jax_tma.quantize_fp8(w, (1, None), dtype)
    ref = _f64(a, s_a, (1, None)) @ _f64(b, s_b, (1, None)).T
    bias = rng.standard_normal(n).astype(np.float32)
    out = _kernel(a, b, s_a.reshape(-1), s_b.reshape(-1), bias, row_scale=fp8.VECTOR,
                  col_scale=fp8.VECTOR, has_bias=True, out_dtype=out_dtype, config=config,
                  promote=False)
    assert rel_error(out, ref + bias) <= OUT_TOL[out_dtype]


def test_precision_picks_the_accumulation():
    """None / HIGH / HIGHEST promote; DEFAULT and the FAST_ACCUM preset accumulate in the
    tensor core unless a block scale asks for promotion; a fast product's config must be a
    fast tile."""
    b = _spec((768, 1024), E4M3)
    sa, sb = _spec((8, 512), F32), _spec((8, 6), F32)

    def promote(precision, a_scale=2.0, b_scale=0.5, config=None, rows=512):
        lhs = _spec((rows, 1024), E4M3)
        jaxpr = jax.make_jaxpr(lambda a, b, sa, sb: jax_tma.fp8_dot_general(
            a, b, a_scale if a_scale is not None else sa, b_scale if b_scale is not None else sb,
            precision=precision, config=config))(lhs, b, sa, sb)
        found = re.findall(r"promote=(True|False)", str(jaxpr))
        assert len(found) == 1, str(jaxpr)
        return found[0] == "True"

    assert promote(None) and promote("high") and promote(jax.lax.Precision.HIGHEST)
    assert not promote(jax.lax.Precision.DEFAULT) and not promote("default")
    assert not promote(jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM)
    assert promote(jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32)
    assert promote("default", a_scale=None) and promote("default", b_scale=None)
    assert not promote("default", config=fp8_config.FP8_FAST_CONFIGS[0])
    slow = next(c for c in fp8_config.FP8_CONFIGS
                if c.tile not in {f.tile for f in fp8_config.FP8_FAST_CONFIGS})
    with pytest.raises(ValueError, match="fast accumulation .* is compiled for"):
        promote("default", config=slow)
    assert promote(None, config=slow)
    # 128 rows or fewer: the promoted kernel (its 64-row tiles), unless a fast tile is asked for.
    few = fp8_api.FAST_MIN_ROWS - 1
    assert promote("default", rows=few) and promote("default", config=slow, rows=few)
    assert not promote("default", config=fp8_config.FP8_FAST_CONFIGS[0], rows=few)
    assert not promote("default", rows=fp8_api.FAST_MIN_ROWS)


# Stream-K: the tiles that take it, promoted and fast. 1000 x 4000 on 128 x 128 tiles is 256
# tiles (a whole wave of 132, then 124 tiles' K slices dealt out), on 128 x 192 tiles 168 (36
# dealt out), on 128 x 256 tiles 128 (one part-empty wave, all dealt out); 200 x 776 x 2080 is
# 14, 10 or 8 tiles of 17 slices each.
STREAM_K_CONFIGS = stream_k_variants(fp8_config.FP8_CONFIGS)
STREAM_K_FAST_CONFIGS = stream_k_variants(fp8_config.FP8_FAST_CONFIGS)
STREAM_K_SHAPES = [(1000, 4000, 1040), (200, 776, 2080)]


def _streams(config, m, n, k) -> bool:
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    return config.stream_k_applies(tiles, k, jax_tma._core.device.num_sms()) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("shape", STREAM_K_SHAPES, ids=str)
@pytest.mark.parametrize("config", STREAM_K_CONFIGS, ids=_config_id)
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_kernel_stream_k_matches_float64(rng, config, shape, out_dtype):
    """Promoted stream-K pieces, block-scaled with a bias and per-tensor (the scale folded into
    the promotion), add up to the whole product; deterministic from call to call."""
    m, n, k = shape
    assert _streams(config, m, n, k)
    a, b, sa, sb, ref = _block_operands(rng, m, n, k)
    bias = rng.standard_normal(n).astype(np.float32)
    out = _kernel(a, b, sa, sb, bias, has_sa=True, has_sb=True, has_bias=True,
                  out_dtype=out_dtype, config=config)
    assert rel_error(out, ref + bias) <= OUT_TOL[out_dtype]
    again = _kernel(a, b, sa, sb, bias, has_sa=True, has_sb=True, has_bias=True,
                    out_dtype=out_dtype, config=config)
    assert np.array_equal(out, again)
    x, w = _data(rng, (m, k)), _data(rng, (n, k)) / np.sqrt(k)
    a, s_a = jax_tma.quantize_fp8(x)
    b, s_b = jax_tma.quantize_fp8(w)
    ref = _f64(a, s_a, None) @ _f64(b, s_b, None).T
    out = _kernel(a, b, s_a.reshape(()), s_b.reshape(()), row_scale=fp8.SCALAR,
                  col_scale=fp8.SCALAR, out_dtype=out_dtype, config=config)
    assert rel_error(out, ref) <= OUT_TOL[out_dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", STREAM_K_SHAPES, ids=str)
@pytest.mark.parametrize("config", STREAM_K_FAST_CONFIGS, ids=_config_id)
def test_kernel_fast_stream_k_matches_float64(rng, config, shape):
    """The tensor core's accumulation on stream-K, row and column scales in the epilogue."""
    m, n, k = shape
    assert _streams(config, m, n, k)
    x, w = _data(rng, (m, k)), _data(rng, (n, k)) / np.sqrt(k)
    a, s_a = jax_tma.quantize_fp8(x, (1, None))
    b, s_b = jax_tma.quantize_fp8(w, (1, None))
    ref = _f64(a, s_a, (1, None)) @ _f64(b, s_b, (1, None)).T
    out = _kernel(a, b, s_a.reshape(-1), s_b.reshape(-1), row_scale=fp8.VECTOR,
                  col_scale=fp8.VECTOR, out_dtype=F32, config=config, promote=False)
    assert rel_error(out, ref) <= OUT_TOL[F32]


def test_stream_k_configs_and_errors():
    """stream_k=True only on 128-row tiles without a cluster and without split-K; the heuristic
    considers it only where the tiles fill at least one wave (on fewer, split-K cuts K better),
    fp8_autotune times it last where it applies, and the lowering passes it on."""
    assert STREAM_K_CONFIGS and STREAM_K_FAST_CONFIGS
    with pytest.raises(ValueError, match="stream_k needs block_m=128, cluster_m=1"):
        fp8_config.Fp8Config(128, 192, 4, 2, stream_k=True)
    with pytest.raises(ValueError, match="stream_k needs"):
        fp8_config.Fp8Config(128, 128, 5, 1, split_k=2, stream_k=True)
    promoted = {(128, 256, 3, 1), (128, 192, 4, 1), (128, 128, 5, 1)}
    for fast, tiles in ((False, promoted), (True, {(128, 128, 5, 1)})):
        assert not any(c.stream_k for c in fp8_config.ranked_configs(
            128, 2112, 7168, num_sms=132, fast=fast))
        every = fp8_config.ranked_configs(128, 2112, 7168, num_sms=132, fast=fast,
                                          measured_only=False)
        streamed = [c for c in every if c.stream_k]
        assert {c.tile for c in streamed} == tiles
        assert every[-len(streamed):] == streamed
    # 12 x 11 tiles of 128 x 256 fill 132 SMs: no stream-K for that tile.
    assert not any(c.stream_k and c.block_n == 256 for c in fp8_config.ranked_configs(
        1536, 2816, 4096, num_sms=132, measured_only=False))
    # 4096^3 on 128 x 192 tiles: 704 tiles, 5.33 waves of 132. Whole tiles pay for 6 waves,
    # stream-K for 5 + 44 / 132 + _STREAM_K_EXTRA_WAVES: the heuristic's choice.
    streamed = fp8_config.Fp8Config(128, 192, 4, 1, stream_k=True)
    assert fp8_config.default_config(4096, 4096, 4096, num_sms=132) == streamed
    whole = dataclasses.replace(streamed, stream_k=False)
    est = functools.partial(fp8_config.estimate_seconds, m=4096, n=4096, k=4096, num_sms=132,
                            dram_bytes_per_s=4.8e12)
    ratio = est(streamed) / est(whole)
    assert ratio == pytest.approx((5 + 44 / 132 + fp8_config._STREAM_K_EXTRA_WAVES) / 6)
    # 6144^3: 1536 tiles, 11.6 waves; the last wave's share plus the extra cost exceeds it.
    assert not fp8_config.default_config(6144, 6144, 6144, num_sms=132).stream_k
    cfg = STREAM_K_CONFIGS[0]
    a, b = (jax.ShapeDtypeStruct(s, E4M3) for s in ((128, 7168), (2112, 7168)))
    hlo = cuda_hlo(lambda a, b: jax_tma.fp8_dot_general(a, b, 1.0, 1.0, config=cfg), a, b)
    assert "stream_k = 1 : i64" in hlo
    # Its workspace is the call's second result, sized for the whole grid (a smaller one would
    # shrink the grid that shares the last wave).
    workspace = cfg.stream_k_workspace_bytes(jax_tma._core.device.num_sms())
    assert workspace > 0 and f"tensor<{workspace}xui8>" in hlo


@needs_extension
def test_heuristic_picks_the_measured_fastest_tiles():
    """Every compiled tile has a measured rate. The promoted heuristic picks 128 x 192 tiles
    without a cluster (one group per slice, the cross schedule) for large products, on stream-K
    where their last wave is part-empty; the fast one picks the 128 x 192 pairs where the H200
    sweep found them fastest (N = 2112: 1333 TFLOP/s against 1174 for the 128 x 128 tile and 1042
    for the 128 x 256 pairs) and the 128 x 256 pairs where those were (16384 x 7168 x 2048). A
    config= tile runs when asked for."""
    assert {fp8_config.rate_key(c.tile) for c in fp8_config.FP8_CONFIGS} == set(
        fp8_config._TILE_EFFICIENCY)
    assert {fp8_config.rate_key(c.tile) for c in fp8_config.FP8_FAST_CONFIGS} == set(
        fp8_config._FAST_EFFICIENCY)
    for m, n, k in [(8192, 8192, 8192), (4096, 2112, 7168), (16384, 7168, 2048)]:
        assert fp8_config.default_config(m, n, k, num_sms=132) == fp8_config.Fp8Config(
            128, 192, 4, 1)
    for m, n, k in [(4096, 4096, 7168), (4096, 7168, 2048)]:
        assert fp8_config.default_config(m, n, k, num_sms=132) == fp8_config.Fp8Config(
            128, 192, 4, 1, stream_k=True)
    fast = functools.partial(fp8_config.default_config, num_sms=132, fast=True)
    assert fast(4096, 2112, 7168).tile == (128, 192, 4, 2)
    assert fast(16384, 7168, 2048).tile == (128, 256, 3, 2)
    a, b = (jax.ShapeDtypeStruct(s, E4M3) for s in ((4096, 7168), (2112, 7168)))
    for cfg in fp8_config.FP8_FAST_CONFIGS:
        hlo = cuda_hlo(lambda a, b: jax_tma.fp8_dot_general(
            a, b, 1.0, 1.0, precision=jax.lax.Precision.DEFAULT, config=cfg), a, b)
        assert f"block_n = {cfg.block_n} : i64" in hlo and "promote = 0 : i64" in hlo


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (1, 1000, 1000), (7, 8, 16), (64, 136, 200),
                                   (130, 1001, 4100)])
def test_kernel_edge_shapes(rng, m, n, k):
    x, w = _data(rng, (m, k)), _data(rng, (n, k)) / np.sqrt(k)
    a, sa = jax_tma.quantize_fp8(x, (1, 128))
    b, sb = jax_tma.quantize_fp8(w, (128, 128))
    ref = _f64(a, sa, (1, 128)) @ _f64(b, sb, (128, 128)).T
    out = jax.jit(lambda a, b, sa, sb: jax_tma.fp8_dot_general(
        a, b, sa, sb, out_dtype=jnp.float32))(a, b, sa, sb)
    assert out.shape == (m, n)
    assert rel_error(out, ref) <= OUT_TOL[F32]
    hlo = jax.jit(lambda a, b, sa, sb: jax_tma.fp8_dot_general(a, b, sa, sb)).lower(
        a, b, sa, sb).as_text()
    assert fp8.KERNEL_TARGET in hlo


@pytest.mark.gpu
@pytest.mark.parametrize("config", [c for c in fp8_config.FP8_CONFIGS
                                    if c.tile in {(128, 256, 3, 2), (128, 192, 4, 2),
                                                  (128, 144, 6, 2)}], ids=_config_id)
def test_kernel_is_deterministic(rng, config):
    a, b, sa, sb, _ = _block_operands(rng, 1024, 1024, 2048)
    first = _kernel(a, b, sa, sb, has_sa=True, has_sb=True, out_dtype=BF16, config=config)
    for _ in range(3):
        again = _kernel(a, b, sa, sb, has_sa=True, has_sb=True, out_dtype=BF16, config=config)
        assert np.array_equal(first, again)


@pytest.mark.gpu
def test_kernel_vector_scales_and_vmap(rng):
    x = _data(rng, (2, 300, 512))
    w = _data(rng, (264, 512)) / 20
    a, sa = jax_tma.quantize_fp8(x, (1, None))
    b, sb = jax_tma.quantize_fp8(w, (1, None))
    out = jax.jit(jax.vmap(lambda a, s: jax_tma.fp8_dot_general(a, b, s, sb, bias=sb[:, 0])))(
        a, sa)
    for i in range(2):
        ref = _f64(a[i], sa[i], None) @ _f64(b, sb, None).T + np.asarray(sb[:, 0])
        assert rel_error(out[i], ref) <= OUT_TOL[BF16]


@pytest.mark.gpu
def test_kernel_gradients_run_the_bf16_kernel(rng):
    x = jnp.asarray(_data(rng, (256, 512), spread=False), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 384)) / 20, jnp.bfloat16)

    def loss(x, w):
        a, sa = jax_tma.quantize_fp8(x, (1, 128))
        b, sb = jax_tma.quantize_fp8(w, (128, 128))
        return jnp.sum(jax_tma.fp8_matmul(a, b, sa, sb).astype(F32) ** 2)

    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    ref_dx, ref_dw = jax.grad(lambda x, w: jnp.sum((x.astype(F32) @ w.astype(F32)) ** 2),
                              (0, 1))(x, w)
    assert rel_error(dx, ref_dx) <= 0.1 and rel_error(dw, ref_dw) <= 0.1


def test_preferred_element_type_is_lax_keyword_and_out_dtype_its_alias(rng):
    a = jnp.asarray(random_array(rng, (128, 256), np.float32)).astype(jnp.float8_e4m3fn)
    b = jnp.asarray(random_array(rng, (64, 256), np.float32)).astype(jnp.float8_e4m3fn)
    one = jnp.float32(1)
    by_keyword = jax_tma.fp8_dot_general(a, b, one, one, preferred_element_type=jnp.float32)
    by_alias = jax_tma.fp8_dot_general(a, b, one, one, out_dtype=jnp.float32)
    assert by_keyword.dtype == by_alias.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(by_keyword), np.asarray(by_alias))
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
    # On Hopper the tensor core sums each 128-K slice at less than fp32's precision (1.3e-4 seen).
    assert rel_error(by_keyword, ref) < 1e-3
    assert jax_tma.fp8_dot_general(a, b, one, one).dtype == jnp.bfloat16
    mm = jax_tma.fp8_matmul(a, b.T, one, one, preferred_element_type=jnp.float32,
                            precision=jax.lax.Precision.HIGHEST)
    assert mm.dtype == jnp.float32 and rel_error(mm, ref) < 1e-3
    with pytest.raises(ValueError, match="out_dtype is another name"):
        jax_tma.fp8_matmul(a, b.T, one, one, out_dtype=jnp.float32,
                           preferred_element_type=jnp.bfloat16)
