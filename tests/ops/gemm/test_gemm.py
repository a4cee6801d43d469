"""jax_tma.matmul: jnp.matmul parity, the CUDA lowering, and the sm90 kernel on a Hopper GPU.

Error bounds (Frobenius-norm relative error against a float64 reference on random data):
bf16 operands/output 1e-2, fp16 2e-3, fp32 output from 16-bit operands 1e-5; fp32 operands
2e-3 (XLA's default precision runs them as TF32 on GPUs). The jnp.matmul parity tests measure
error against |a| @ |b|, so a short dot with cancellation is not held to a relative bound it
cannot meet.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_tma
from jax_tma import _ext, _testing
from jax_tma.ops.gemm import config as gemm_config
from jax_tma.ops.gemm import plan as gemm_plan
from jax_tma.ops.gemm import primitive as gemm
from jax_tma._core import device
from jax_tma._core.config import stream_k_variants
from support import cuda_hlo, f64_matmul, needs_extension, random_array, rel_error

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
TOL = {BF16: 1e-2, F16: 2e-3, np.dtype(np.float32): 1e-5}
F32_OPERAND_TOL = 2e-3


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


# ---------------------------------------------------------------- jnp.matmul parity (CPU)

PARITY_CASES = [
    ((64, 32), (32, 48), BF16, None),
    ((5, 8), (8, 7), F16, None),
    ((64, 32), (32, 48), BF16, np.float32),
    ((64, 32), (32, 48), F16, BF16),
    ((64, 30), (30, 48), BF16, None),  # K % 8 != 0: a's rows padded
    ((3, 64, 32), (32, 16), BF16, None),  # batched, broadcast
    ((2, 3, 8, 16), (3, 16, 4), F16, None),
    ((16,), (16, 8), BF16, None),  # 1-D operands
    ((8, 16), (16,), BF16, None),
    ((16,), (16,), BF16, None),
    ((32, 16), (16, 24), np.float32, None),
    ((32, 16), (16, 24), np.int32, None),
    ((0, 16), (16, 8), BF16, None),  # empty
    ((8, 0), (0, 8), BF16, None),
]


@pytest.mark.parametrize("a_shape,b_shape,dtype,out_dtype", PARITY_CASES)
def test_abstract_eval_matches_jnp(a_shape, b_shape, dtype, out_dtype):
    args = (spec(a_shape, dtype), spec(b_shape, dtype))
    ours = jax.eval_shape(lambda a, b: jax_tma.matmul(a, b, out_dtype=out_dtype), *args)
    ref = jax.eval_shape(lambda a, b: jnp.matmul(a, b, preferred_element_type=out_dtype), *args)
    assert (ours.shape, ours.dtype) == (ref.shape, ref.dtype)


def test_mixed_input_dtypes_match_jnp():
    args = (spec((16, 16), BF16), spec((16, 16), F16))
    ours = jax.eval_shape(jax_tma.matmul, *args)
    ref = jax.eval_shape(jnp.matmul, *args)
    assert (ours.shape, ours.dtype) == (ref.shape, ref.dtype)


@pytest.mark.parametrize("a_shape,b_shape,dtype,out_dtype", PARITY_CASES)
def test_values_match_float64_reference(rng, a_shape, b_shape, dtype, out_dtype):
    if np.dtype(dtype).kind == "i":
        a, b = (rng.integers(-8, 8, s).astype(dtype) for s in (a_shape, b_shape))
    else:
        a, b = (random_array(rng, s, dtype) for s in (a_shape, b_shape))
    out = jax_tma.matmul(a, b, out_dtype=out_dtype)
    ref = f64_matmul(a, b)
    assert out.shape == ref.shape
    if out.dtype.kind == "i":
        np.testing.assert_array_equal(np.asarray(out), ref)
    elif ref.size:
        scale = f64_matmul(np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64)))
        tol = F32_OPERAND_TOL if np.dtype(dtype) == np.float32 else TOL[np.dtype(out.dtype)]
        assert np.linalg.norm(np.asarray(out, np.float64) - ref) <= tol * np.linalg.norm(scale)
    xla = jnp.matmul(a, b, preferred_element_type=out_dtype)
    assert out.dtype == xla.dtype
    if out.dtype.kind == "i" or not jax_tma.kernel_status().available:
        # The same XLA computation: identical bits.
        np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(xla, np.float64))


ERROR_CASES = [
    ((4, 8), (7, 4)),  # contracting mismatch
    ((4, 8), (2, 7, 4)),  # batched contracting mismatch
    ((2, 4, 8), (3, 8, 4)),  # batch dims do not broadcast
    ((), (8, 4)),  # 0-d operand
    ((4, 8), ()),
]


@pytest.mark.parametrize("a_shape,b_shape", ERROR_CASES)
def test_errors_match_jnp(a_shape, b_shape):
    a, b = jnp.ones(a_shape, BF16), jnp.ones(b_shape, BF16)
    with pytest.raises(Exception) as ref:
        jnp.matmul(a, b)
    with pytest.raises(type(ref.value)) as ours:
        jax_tma.matmul(a, b)
    assert str(ours.value) == str(ref.value)


def test_bad_out_dtype_matches_jnp():
    a = jnp.ones((8, 8), BF16)
    with pytest.raises(Exception) as ref:
        jnp.matmul(a, a, preferred_element_type="not-a-dtype")
    with pytest.raises(type(ref.value)):
        jax_tma.matmul(a, a, out_dtype="not-a-dtype")


def test_config_validation():
    with pytest.raises(ValueError, match="block_n=192, stages=5"):
        jax_tma.GemmConfig(block_n=192, stages=5)
    with pytest.raises(ValueError, match="not a compiled configuration"):
        jax_tma.GemmConfig(block_n=256, stages=9)
    with pytest.raises(ValueError, match="not a compiled configuration"):
        jax_tma.GemmConfig(block_m=64, block_n=256, stages=5, cluster_m=1)
    with pytest.raises(ValueError, match="split_k"):
        jax_tma.GemmConfig(split_k=0)
    with pytest.raises(ValueError, match="split_k"):
        jax_tma.GemmConfig(split_k=gemm_config.MAX_SPLIT_K + 1)
    with pytest.raises(ValueError, match="stream_k needs block_m=128, cluster_m=1 and split_k=1"):
        jax_tma.GemmConfig(cluster_m=2, stream_k=True)
    with pytest.raises(ValueError, match="stream_k needs"):
        jax_tma.GemmConfig(64, 128, 8, 1, stream_k=True)
    with pytest.raises(ValueError, match="stream_k needs"):
        jax_tma.GemmConfig(128, 128, 6, 1, split_k=2, stream_k=True)
    with pytest.raises(ValueError, match="stream_k must be a bool"):
        jax_tma.GemmConfig(128, 128, 6, 1, stream_k=1)
    with pytest.raises(TypeError, match="GemmConfig"):
        jax_tma.matmul(jnp.ones((8, 8), BF16), jnp.ones((8, 8), BF16), config={"block_n": 128})
    for cfg in jax_tma.COMPILED_CONFIGS:
        assert jax_tma.GemmConfig(cfg.block_m, cfg.block_n, cfg.stages, cfg.cluster_m) == cfg


def test_config_rejects_unaligned_output_without_direct_store():
    """TMA stores need 16-byte output rows: an N of 4097 bf16 needs a direct-store tile."""
    a, b = jnp.ones((64, 128), BF16), jnp.ones((128, 4097), BF16)
    wide = jax_tma.GemmConfig(128, 256, 3, 2)
    with pytest.raises(ValueError, match=r"\(64, 4097\) output of bfloat16 has rows 8194 bytes apart"):
        jax_tma.matmul(a, b, config=wide)
    # Split-K partial products are fp32: 4097 * 4 bytes is still not a multiple of 16.
    with pytest.raises(ValueError, match="rows 16388 bytes apart"):
        jax_tma.matmul(a, b, config=dataclasses.replace(wide, split_k=2))
    jax_tma.matmul(a, b, config=jax_tma.GemmConfig(64, 128, 8, 1))  # has the direct store


def test_heuristic_follows_the_device_bandwidth():
    """The memory model scales with the device's peak DRAM bandwidth (H100 sweep, 2026-11-21)."""
    h100 = 3.352e12  # 2619 MHz, two transfers per clock, 5120-bit bus
    # Memory-bound: on an H100, 64 x 64 tiles without split-K ran 128 x 4096 x 14336 in 43.4 us,
    # 64 x 128 tiles split in two (the H200's choice then) in 46.2.
    cfg = gemm_config.default_config(128, 4096, 14336, dram_bytes_per_s=h100)
    assert (cfg.tile[:2], cfg.split_k) == ((64, 64), 1), cfg
    # ...but not at the price of more operand bytes per SM: 512 x 512 x 65536 keeps 128 x 128
    # tiles split 8 ways (57.0 us there, against 61.2 for 64 x 128 tiles split 4 ways).
    cfg = gemm_config.default_config(512, 512, 65536, dram_bytes_per_s=h100)
    assert (cfg.tile[:2], cfg.split_k) == ((128, 128), 8), cfg
    # Compute-bound products keep their configuration whatever the bandwidth.
    for shape in [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
                  (16384, 4096, 4096), (8192, 10240, 8192)]:
        for bandwidth in (h100, 2 * h100):
            assert gemm_config.default_config(*shape, dram_bytes_per_s=bandwidth) == gemm_config.default_config(*shape)
    # Less bandwidth never makes a memory-bound estimate faster.
    tile = jax_tma.GemmConfig(64, 64, 12, 1)
    assert gemm_config.estimate_seconds(tile, 1, 4096, 4096, dram_bytes_per_s=h100) > gemm_config.estimate_seconds(
        tile, 1, 4096, 4096)
    for bad in (0, -1.0, float("inf"), float("nan"), "3e12", None):
        with pytest.raises(ValueError, match="dram_bytes_per_s must be a positive number"):
            gemm_config.default_config(128, 4096, 14336, dram_bytes_per_s=bad)


def test_default_config_rejects_unknown_misaligned_operands():
    """`misaligned_rows` names operands: anything but "a" and "b" is an error, not ignored."""
    for bad in (True, "c", "ab ", ["a"]):
        with pytest.raises(ValueError, match='misaligned_rows must be a string of "a" and/or "b"'):
            gemm_config.default_config(1000, 1000, 1000, misaligned_rows=bad)


def test_splits_are_never_empty():
    cfg = jax_tma.GemmConfig(128, 128, 6, 2, split_k=16)
    assert cfg.splits_for(64) == 1
    assert cfg.splits_for(64 * 5) == 5
    assert cfg.splits_for(64 * 17) == 9  # 2 K blocks per range, 9 ranges
    assert cfg.splits_for(65536) == 16


HEURISTIC_SHAPES = [
    (8192, 8192, 8192), (16384, 28672, 4096), (1, 4096, 4096), (16, 6144, 4096),
    (64, 28672, 4096), (128, 4096, 14336), (512, 512, 65536), (4095, 4097, 4096),
    (1000, 1000, 1000), (3000, 5000, 2048), (7, 7, 8),
]


@pytest.mark.parametrize("m,n,k", HEURISTIC_SHAPES)
def test_default_config_is_legal(m, n, k):
    for out_dtype in (BF16, np.float32):
        cfg = gemm_config.default_config(m, n, k, out_dtype=out_dtype)
        gemm_config.check_config(cfg, m, n, k, out_dtype)


@pytest.mark.parametrize("m,n,k", HEURISTIC_SHAPES)
def test_ranked_configs_start_with_the_default(m, n, k):
    """ranked_configs (what autotune(max_candidates=N) times) orders every scored configuration
    by the cost model, default_config's choice first."""
    for out_dtype in (BF16, np.float32):
        ranked = gemm_config.ranked_configs(m, n, k, out_dtype=out_dtype)
        assert ranked[0] == gemm_config.default_config(m, n, k, out_dtype=out_dtype)
        assert sorted(map(str, ranked)) == sorted(
            map(str, gemm_config.scored_configs(m, n, k, out_dtype)))
        estimates = [gemm_config.estimate_seconds(c, m, n, k, out_bytes=np.dtype(out_dtype).itemsize)
                     for c in ranked]
        assert all(round(a, 9) <= round(b, 9) for a, b in zip(estimates, estimates[1:]))


def test_default_config_heuristic():
    big = gemm_config.default_config(8192, 8192, 8192)
    assert (big.block_m, big.block_n, big.split_k) == (128, 256, 1)
    # Skinny M: 64-row tiles; few tiles over a long K: split-K fills the GPU.
    assert gemm_config.default_config(16, 6144, 4096).block_m == 64
    assert gemm_config.default_config(512, 512, 65536).split_k > 1
    # Unaligned output rows: a tile with the direct-store epilogue.
    assert gemm_config.default_config(4095, 4097, 4096).has_direct_store


def _unavailable_warnings(call) -> list:
    """The jax_tma warnings that `call()` raises in a fresh process state (skips where the
    kernels are available: nothing to warn about)."""
    if jax_tma.kernel_status().available:
        pytest.skip("kernels are available here; nothing to warn about")
    _ext.warn_if_unavailable.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [w for w in caught if "jax_tma" in str(w.message)]


def test_warns_once_when_kernels_unavailable():
    a = jnp.ones((8, 8), BF16)
    found = _unavailable_warnings(lambda: (jax_tma.matmul(a, a), jax_tma.matmul(a, a)))
    assert len(found) == 1 and jax_tma.kernel_status().reason in str(found[0].message)


def test_unavailable_warning_points_at_the_callers_line():
    """Under jit too: the warning names this file, not a frame inside jax or jax_tma."""
    a = jnp.ones((8, 8), BF16)
    found = _unavailable_warnings(lambda: jax.jit(lambda x: jax_tma.matmul(x, x))(a))
    assert len(found) == 1 and found[0].filename == __file__, [w.filename for w in found]


# ---------------------------------------------------------------- CUDA lowering (CPU)


@needs_extension
@pytest.mark.parametrize(
    "m,n,k,dtype,out_dtype",
    [(128, 256, 64, BF16, None), (7, 129, 8, F16, None), (1, 1, 8, BF16, np.float32),
     (4097, 7, 72, F16, None), (64, 64, 30, BF16, None)],
)
@pytest.mark.smoke
def test_cuda_lowering_emits_kernel(m, n, k, dtype, out_dtype):
    hlo = cuda_hlo(lambda a, b: jax_tma.matmul(a, b, out_dtype=out_dtype), spec((m, k), dtype), spec((k, n), dtype))
    assert hlo.count(f"custom_call @{gemm.KERNEL_TARGET}(") == 1
    assert "stablehlo.dot_general" not in hlo
    # Rows that are not 16-byte multiples are padded once (b's for N, a's for K).
    assert ("stablehlo.pad" in hlo) == (n % 8 != 0 and n > 1 or k % 8 != 0)


@needs_extension
@pytest.mark.parametrize(
    "a_shape,b_shape",
    [((4, 64, 32), (32, 64)), ((32,), (32, 64)), ((64, 32), (32,)), ((3, 64, 32), (3, 32, 16)),
     ((64, 32), (3, 32, 16))],
    ids=["batch-folded-into-m", "vector-matrix", "matrix-vector", "batched", "rhs-batched"],
)
def test_cuda_lowering_batched_and_vector_products_run_kernel(a_shape, b_shape):
    hlo = cuda_hlo(jax_tma.matmul, spec(a_shape, BF16), spec(b_shape, BF16))
    assert hlo.count(f"custom_call @{gemm.KERNEL_TARGET}(") == 1
    assert "stablehlo.dot_general" not in hlo


@needs_extension
@pytest.mark.parametrize(
    "a_shape,b_shape,a_dtype,b_dtype",
    [
        ((64, 32), (32, 64), np.float32, np.float32),
        ((64, 32), (32, 64), BF16, F16),
        ((2, 1, 64, 32), (1, 3, 32, 64), BF16, BF16),  # broadcast batch shapes
        ((64, 32), (32, 64), np.int8, np.int8),
    ],
)
def test_cuda_lowering_falls_back(a_shape, b_shape, a_dtype, b_dtype):
    hlo = cuda_hlo(jax_tma.matmul, spec(a_shape, a_dtype), spec(b_shape, b_dtype))
    assert "jax_tma_" not in hlo
    assert "stablehlo.dot_general" in hlo


@needs_extension
def test_cuda_lowering_falls_back_for_other_output_types():
    """The kernel writes its input type or fp32; bf16 -> fp16 goes to XLA."""
    hlo = cuda_hlo(lambda a, b: jax_tma.matmul(a, b, out_dtype=F16), spec((64, 32), BF16), spec((32, 64), BF16))
    assert "jax_tma_" not in hlo and "stablehlo.dot_general" in hlo


@needs_extension
def test_cuda_lowering_split_k_sums_partial_products():
    cfg = jax_tma.GemmConfig(128, 128, 6, 2, split_k=4)
    hlo = cuda_hlo(lambda a, b: jax_tma.matmul(a, b, config=cfg), spec((512, 1024), BF16), spec((1024, 512), BF16))
    assert hlo.count(f"custom_call @{gemm.KERNEL_TARGET}(") == 1
    assert "splits = 4" in hlo and "tensor<4x512x512xf32>" in hlo
    # summed in a fixed order (((d0 + d1) + d2) + d3), not a reduce whose order XLA picks
    assert hlo.count("stablehlo.add") == 3 and "stablehlo.reduce" not in hlo
    assert "stablehlo.dot_general" not in hlo


@needs_extension
def test_cuda_lowering_respects_disable(monkeypatch):
    monkeypatch.setenv("JAX_TMA_DISABLE", "1")
    # A new function: jax caches lowerings by the traced function, and others lower matmul.
    hlo = cuda_hlo(lambda a, b: jax_tma.matmul(a, b), spec((64, 32), BF16), spec((32, 64), BF16))
    assert "jax_tma_" not in hlo and "stablehlo.dot_general" in hlo


@needs_extension
def test_cuda_lowering_forced_config():
    cfg = jax_tma.GemmConfig(block_m=128, block_n=128, stages=6, cluster_m=1)
    hlo = cuda_hlo(lambda a, b: jax_tma.matmul(a, b, config=cfg), spec((8192, 64), BF16), spec((64, 8192), BF16))
    for attr in ("block_m = 128", "block_n = 128", "stages = 6", "cluster_m = 1", "epilogue = 0", "splits = 1"):
        assert attr in hlo, attr
    # Unaligned output rows take the direct-store epilogue.
    hlo = cuda_hlo(lambda a, b: jax_tma.matmul(a, b, config=cfg), spec((64, 64), BF16), spec((64, 7), BF16))
    assert "epilogue = 1" in hlo
    assert "stream_k = 0" in hlo and "tensor<0xui8>" in hlo  # no workspace without stream-K
    # Stream-K: a workspace result of a flag per warpgroup (padded) and an fp32 tile per SM.
    sk = dataclasses.replace(cfg, stream_k=True)
    hlo = cuda_hlo(lambda a, b: jax_tma.matmul(a, b, config=sk), spec((8192, 64), BF16), spec((64, 8192), BF16))
    sms = device.num_sms()
    assert "stream_k = 1" in hlo
    assert f"tensor<{-(-sms * 8 // 256) * 256 + sms * 128 * 128 * 4}xui8>" in hlo


@pytest.mark.smoke
def test_extension_built_when_required():
    if os.environ.get("JAX_TMA_REQUIRE_EXTENSION") != "1":
        pytest.skip("JAX_TMA_REQUIRE_EXTENSION is not set")
    assert _ext.extension_error() is None, _ext.extension_error()


# ---------------------------------------------------------------- the kernel (Hopper GPU)

MN = (1, 7, 64, 127, 129, 1000, 4097)
KS = (8, 64, 72, 200, 1024, 4104, 8192)
GPU_CASES = [
    (m, n, KS[(i + 2 * j) % len(KS)], BF16 if (i + j) % 2 == 0 else F16)
    for i, m in enumerate(MN)
    for j, n in enumerate(MN)
]
# Every compiled tile, plus split-K on a clustered and a 64-row tile, and stream-K on every tile
# that takes it: each one the heuristic can pick. (Stream-K deals out the K slices of the tiles
# left over after whole waves; with 132 CTAs that is every tile of the smaller products, cut
# into many pieces when K is long, and the last 33 tiles of 4097 x 4097 in 128 x 256.)
GPU_CONFIGS = [
    None,
    *gemm_config.COMPILED_CONFIGS,
    jax_tma.GemmConfig(128, 128, 6, 2, split_k=4),
    jax_tma.GemmConfig(64, 128, 8, 1, split_k=3),
    *stream_k_variants(gemm_config.COMPILED_CONFIGS),
]
CONFIG_IDS = ["default"] + [
    f"m{c.block_m}n{c.block_n}s{c.stages}c{c.cluster_m}k{c.split_k}" + ("sk" if c.stream_k else "")
    for c in GPU_CONFIGS[1:]
]

_REF_CACHE: dict = {}


def _operands(m, n, k, dtype):
    key = (m, n, k, dtype)
    if key not in _REF_CACHE:
        rng = np.random.default_rng(m * 1_000_003 + n * 1009 + k)
        a, b = random_array(rng, (m, k), dtype), random_array(rng, (k, n), dtype)
        _REF_CACHE.clear()  # keep one large reference alive at a time
        _REF_CACHE[key] = (a, b, f64_matmul(a, b))
    return _REF_CACHE[key]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("m,n,k,dtype", GPU_CASES, ids=[f"{m}x{n}x{k}-{d.name}" for m, n, k, d in GPU_CASES])
def test_kernel_matches_float64(m, n, k, dtype, config):
    a, b, ref = _operands(m, n, k, dtype)
    if config is not None and not _can_store(config, m, n, k, dtype):
        with pytest.raises(ValueError, match="16 bytes"):
            _testing.gemm_poisoned(a, b, dtype, config=config)
        return
    out = np.asarray(_testing.gemm_poisoned(a, b, dtype, config=config))
    assert not np.isnan(out).any(), "kernel left poisoned (unwritten) outputs"
    assert rel_error(out, ref) <= TOL[dtype]
    xla = np.asarray(jnp.matmul(a, b))
    assert rel_error(out, xla) <= TOL[dtype]


def _can_store(config, m, n, k, out_dtype) -> bool:
    try:
        gemm_config.check_config(config, m, n, k, out_dtype)
    except ValueError:
        return False
    return True


# fp32 outputs: every configuration that can store the shape (4097 fp32 columns are not
# 16-byte rows: only the direct-store tiles take them).
FP32_CASES = [
    (m, n, k, dtype, config, cid)
    for (m, n, k) in [(129, 1000, 72), (4097, 64, 8192), (7, 4097, 200), (300, 516, 640)]
    for dtype in (BF16, F16)
    for config, cid in zip(GPU_CONFIGS, CONFIG_IDS)
    if config is None or _can_store(config, m, n, k, np.float32)
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,n,k,dtype,config", [c[:5] for c in FP32_CASES],
    ids=[f"{m}x{n}x{k}-{d.name}-{cid}" for m, n, k, d, _, cid in FP32_CASES],
)
def test_kernel_fp32_output(m, n, k, dtype, config):
    a, b, ref = _operands(m, n, k, dtype)
    out = np.asarray(_testing.gemm_poisoned(a, b, np.float32, config=config))
    assert not np.isnan(out).any(), "kernel left poisoned (unwritten) outputs"
    assert rel_error(out, ref) <= TOL[np.dtype(np.float32)]


@pytest.mark.gpu
def test_heuristic_reads_the_device_bandwidth():
    """The driver's memory clock and bus width reach the heuristic: jax_tma.matmul runs the
    configuration that default_config picks for this device's bandwidth."""
    bandwidth = _ext.peak_dram_bytes_per_s(jax.devices()[0])
    assert bandwidth is not None and 1e12 < bandwidth < 2e13, bandwidth  # H100 3.35e12, H200 4.81e12
    assert device.dram_bytes_per_s() == bandwidth
    l2 = _ext.l2_cache_bytes(jax.devices()[0])
    assert l2 is not None and 2**24 <= l2 <= 2**28, l2  # 50 MiB on an H100 or H200
    assert device.l2_bytes() == l2
    m, n, k = 128, 4096, 14336
    cfg = gemm_config.default_config(m, n, k, device.num_sms(), BF16, dram_bytes_per_s=bandwidth)
    hlo = jax.jit(jax_tma.matmul).lower(spec((m, k), BF16), spec((k, n), BF16)).as_text()
    for attr in (f"block_m = {cfg.block_m}", f"block_n = {cfg.block_n}", f"stages = {cfg.stages}",
                 f"cluster_m = {cfg.cluster_m}", f"splits = {cfg.split_k}"):
        assert attr in hlo, (attr, cfg)


@pytest.mark.gpu
def test_public_matmul_runs_kernel_inside_jit(rng):
    """Two shapes through one jitted function, and a second function: all on the kernel."""

    @jax.jit
    def f(a, b):
        return jax_tma.matmul(a, b)

    @jax.jit
    def g(a, b, c):
        return jax_tma.matmul(jax_tma.matmul(a, b), c, out_dtype=jnp.float32)

    for m, n, k in [(1000, 129, 72), (64, 4097, 1024)]:
        a, b = random_array(rng, (m, k), BF16), random_array(rng, (k, n), BF16)
        assert gemm.KERNEL_TARGET in f.lower(a, b).compile().as_text()
        assert rel_error(f(a, b), f64_matmul(a, b)) <= TOL[BF16]
    a, b, c = (random_array(rng, s, F16) for s in [(127, 64), (64, 200), (200, 7)])
    assert gemm.KERNEL_TARGET in g.lower(a, b, c).compile().as_text()
    ab = np.asarray(jax_tma.matmul(a, b))
    assert rel_error(g(a, b, c), f64_matmul(ab, c)) <= TOL[F16]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [None, jax_tma.GemmConfig(128, 128, 6, 2, split_k=4),
     jax_tma.GemmConfig(128, 256, 3, 1, stream_k=True)],
    ids=["default", "split4", "stream_k"],
)
def test_kernel_is_deterministic(rng, config):
    a, b = random_array(rng, (1000, 64 * 9), BF16), random_array(rng, (64 * 9, 4096), BF16)
    f = jax.jit(functools.partial(jax_tma.matmul, config=config))
    first = np.asarray(f(a, b))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(a, b)), first)


def test_heuristic_follows_the_measured_sweeps():
    """Choices the cost model must reproduce from the H200 sweeps it was fitted to."""
    # Decode-like products stream B: the 64 x 64 tile puts the most CTAs on it without split-K
    # (16 x 6144 x 4096: 14.9 us against 15.3 for the best 64 x 128 config)...
    for m, n, k in [(1, 4096, 4096), (16, 6144, 4096), (64, 4096, 4096)]:
        assert gemm_config.default_config(m, n, k).tile[:2] == (64, 64), (m, n, k)
    # ...or split K where the tiles alone leave SMs idle (128 x 4096 x 14336: 64 x 128 split in
    # 2 ran in 34.2 us, 64 x 64 unsplit in 34.9 us, 64 x 128 unsplit in 39.9 us; in a later
    # sweep 35.1, 34.0 and 40.4: a tie the model may break either way on an H200).
    cfg = gemm_config.default_config(128, 4096, 14336)
    assert cfg.tile[:2] == (64, 64) or (cfg.tile[:2] == (64, 128) and cfg.split_k > 1), cfg
    # One wave of 112 tiles 256 wide streams B fastest (64 x 28672 x 4096: 56.9 us against
    # 57.7 for two waves of 64 x 128); a 128-row cluster tile would leave half its CTAs idle on
    # 64 rows (81.9 us).
    assert gemm_config.default_config(64, 28672, 4096).tile == (64, 256, 4, 1)
    # One K slice per tile: the fixed cost per tile keeps tiles large (64 x 64 tiles ran 64
    # batches of 1024 x 1024 x 64 2.2x slower than 128 x 256 ones).
    assert gemm_config.default_config(1024, 1024, 64, batch=64).block_n != 64
    # One wave of small tiles beats a half-empty wave of large ones (1024^3: 6.2 us against
    # 8.2 for 128 x 128); alone, a 64-row tile beats a pair (6.5 us).
    assert gemm_config.default_config(1024, 1024, 1024).tile == (64, 128, 8, 1)
    # Rows 16 but not 32 bytes apart slow the loads; pairs that multicast B halve each CTA's
    # share (1000^3: 8.4 us, against 10.1 alone and 9.7 for 128 x 128 pairs).
    assert gemm_config.default_config(1000, 1000, 1000, misaligned_rows="ab").tile == (64, 128, 8, 2)
    # Misaligned rows of A alone cost a pair more than a CTA that loads all of B
    # (1024 x 1024 x 1000: 6.3 us alone against 7.3 in pairs).
    assert gemm_config.default_config(1024, 1024, 1000, misaligned_rows="a").tile == (64, 128, 8, 1)
    # 3.6 waves of 128 x 256 tiles become 4 of 128 x 232 ones (86.7 us, against 92.5 for
    # 128 x 256 and 89.5 for 128 x 192, 4.9 waves).
    assert gemm_config.default_config(3000, 5000, 2048, misaligned_rows="b").tile == (128, 232, 4, 2)
    # A CTA issues misaligned rows at about 46 GB/s whatever its tile, so where both operands'
    # rows are misaligned, pairs that multicast B win over stream-K alone (H100, 5000^3:
    # 128 x 232 pairs 394.8 us against 525.4 for 128 x 256 stream-K; 1000 x 5000 x 5000:
    # 128 x 192 pairs 95.6 against 141.9 for 128 x 128 stream-K).
    assert gemm_config.default_config(5000, 5000, 5000, misaligned_rows="ab").tile == (128, 232, 4, 2)
    assert gemm_config.default_config(1000, 5000, 5000, misaligned_rows="ab").tile == (128, 192, 4, 2)
    # The same products with aligned rows keep stream-K where it shares the last wave.
    assert gemm_config.default_config(5000, 5000, 5000).stream_k
    # 128 x 128 tiles in pairs lose to the same tiles alone where rows are aligned and N spans
    # more than four of them (H100: 1024 x 10240 x 8192 218.6 us alone against 240.0 in pairs,
    # 2000 x 1024 x 14336 77.4 against 98.0), but win on misaligned rows (8-24 % faster than
    # alone on 11 products) and on narrow N (8192 x 256 x 4096: 30.5 in pairs against 32.9).
    assert gemm_config.default_config(1024, 10240, 8192).tile == (128, 128, 6, 1)
    assert gemm_config.default_config(2000, 1024, 14336).tile == (128, 128, 6, 1)
    assert gemm_config.default_config(2000, 5000, 4096, misaligned_rows="b").tile == (128, 128, 6, 2)
    assert gemm_config.default_config(8192, 256, 4096).tile == (128, 128, 6, 2)
    # Stream-K needs M to fill the tile's rows (64 x 7000 x 4096: 128 x 128 stream-K 35.2 us
    # against 23.4 for 64 x 128 tiles; 64 x 1000 x 1000: 8.8 against 5.3 for 64 x 64 split 4).
    for shape, misaligned in (((64, 7000, 4096), "b"), ((64, 1000, 1000), "ab"),
                              ((64, 1000, 1000), "")):
        picked = gemm_config.default_config(*shape, misaligned_rows=misaligned)
        assert not picked.stream_k or shape[0] >= picked.block_m, (shape, picked)
    # ... but not where 232 columns waste a wave (4096^3: 4.4 waves of them against 3.9).
    assert gemm_config.default_config(4096, 4096, 4096).block_n == 256
    # Stream-K shares a half-empty last wave after many whole ones (8192^3, 15.5 waves of
    # 128 x 256: 1357.7 us against 1371.1), not after few (4096^3, 3.9 waves: 184.2 against
    # 176.7) or in a single one (2048^3: 31.1 against 25.4).
    assert gemm_config.default_config(8192, 8192, 8192).stream_k
    assert gemm_config.default_config(16384, 4096, 4096).stream_k
    assert not gemm_config.default_config(4096, 4096, 4096).stream_k
    assert not gemm_config.default_config(2048, 2048, 2048).stream_k


def test_stream_k_shared_operand_bytes_follow_the_fitted_order():
    """The operand blocks two or more of stream-K's tiles share, in the tile order the charge
    was fitted on (groups of 8 rows: gemm_config._GROUP_M)."""
    sk = jax_tma.GemmConfig(128, 256, 3, 1, stream_k=True)
    # 8192 x 8192: 64 x 32 tiles, 68 left after 15 waves of 132: the last 68 of the last group
    # of 8 row blocks, so all 8 row blocks and column blocks 23-31 (23 holds rows 4-7 only).
    assert gemm_config.stream_k_shared_operand_bytes(sk, 8192, 8192, 28672) == (8 * 128 + 9 * 256) * 28672 * 2
    # A partial last group: 1000 rows are 8 row blocks, 4096 columns 16 column blocks: 128
    # tiles, all left (one wave); each row block is shared, each column block too.
    assert gemm_config.stream_k_shared_operand_bytes(sk, 1000, 4096, 8192) == (8 * 128 + 16 * 256) * 8192 * 2
    # One row block: its column blocks are read by one tile each, only A's rows are shared.
    assert gemm_config.stream_k_shared_operand_bytes(sk, 128, 57344, 8192) == 128 * 8192 * 2
    # Batch entries share nothing with each other: 3 entries of 1 x 64 tiles leave 60 tiles
    # (192 - 132) in entry 2.
    assert gemm_config.stream_k_shared_operand_bytes(sk, 128, 16384, 8192, batch=3) == 128 * 8192 * 2
    # No stream-K, no stream-K share: whole waves (132 tiles) or a config without it.
    assert gemm_config.stream_k_shared_operand_bytes(sk, 128 * 12, 256 * 11, 8192) == 0
    assert gemm_config.stream_k_shared_operand_bytes(jax_tma.GemmConfig(128, 256, 3, 1), 8192, 8192, 28672) == 0


def test_stream_k_pays_for_shared_operands_beyond_l2():
    """Stream-K's ranges start at scattered K offsets, so the blocks its tiles share are read
    again where L2 cannot hold them (H100, 2026-11-21: 4096 x 4096 x 65536 took 3978.7 us with
    stream-K against 2721.7 for the same tiles whole; 8192 x 8192 x 28672 5043.6 against 4852.1;
    8192^3 kept stream-K's lead, 1368.7 against 1378.7)."""
    h100, h200 = 3.352e12, 4.8e12
    for bandwidth in (h100, h200):
        assert not gemm_config.default_config(4096, 4096, 65536, dram_bytes_per_s=bandwidth).stream_k
        assert not gemm_config.default_config(8192, 8192, 28672, dram_bytes_per_s=bandwidth).stream_k
        assert gemm_config.default_config(8192, 8192, 8192, dram_bytes_per_s=bandwidth).stream_k
        assert gemm_config.default_config(16384, 28672, 4096, dram_bytes_per_s=bandwidth).stream_k
    # With 1.4x the bandwidth the H200 re-reads 95-109 MB cheaply enough to keep stream-K
    # (16384 x 4096 x 14336: 2396.1 us against 2422.6; on the H100 2430.2 against 2410.0).
    assert not gemm_config.default_config(16384, 4096, 14336, dram_bytes_per_s=h100).stream_k
    assert gemm_config.default_config(16384, 4096, 14336, dram_bytes_per_s=h200).stream_k
    # A larger L2 holds the shared blocks.
    assert gemm_config.default_config(16384, 4096, 14336, dram_bytes_per_s=h100, l2_bytes=2**27).stream_k
    sk = jax_tma.GemmConfig(128, 256, 3, 1, stream_k=True)
    assert gemm_config.estimate_seconds(sk, 8192, 8192, 28672, l2_bytes=2**20) > gemm_config.estimate_seconds(
        sk, 8192, 8192, 28672)
    for bad in (0, -1, 5e7, True, None, "50MB"):
        with pytest.raises(ValueError, match="l2_bytes must be a positive int"):
            gemm_config.default_config(8192, 8192, 8192, l2_bytes=bad)


# ---------------------------------------------------------------- products left to XLA (CPU)


@pytest.mark.parametrize("m,n,k,why", [
    (4096, 4096, 32, "shorter than one 64-deep K block"),
    (16493, 9023, 11, "shorter than one 64-deep K block"),  # 0.20x XLA on the H100
    (4096, 8, 4096, "narrower than 16 columns"),
    (498, 1, 4941, "narrower than 16 columns"),  # 0.41x
    (1, 18597, 3402, "copying operands"),  # B's rows padded: a second pass over 127 MB; 0.40x
    (7, 129, 72, "copying operands"),
    (29312, 6912, 128, "at most 128 over"),  # 0.89x
    (17728, 24000, 64, "at most 128 over"),  # 0.90x
])
def test_products_xla_computes_faster_run_there(m, n, k, why):
    """The lowering leaves XLA's dot the products it measured faster there (gemm_config.
    xla_reason), unless the caller names a configuration or sets JAX_TMA_KERNEL_ALWAYS."""
    a, b = spec((m, k), BF16), spec((k, n), BF16)
    assert gemm.kernel_choice(a, b, gemm_plan.MATMUL_DIMS, BF16, xla_when_faster=True) is None
    route = gemm.kernel_route(a, b, gemm_plan.MATMUL_DIMS, BF16)
    cfg = gemm.config_for(route.plan, BF16, None)
    assert why in gemm.why_xla(route, cfg, a, b, BF16)
    named = gemm.kernel_choice(a, b, gemm_plan.MATMUL_DIMS, BF16, config=cfg, xla_when_faster=True)
    assert named is not None and named[1] == cfg
    assert gemm.kernel_choice(a, b, gemm_plan.MATMUL_DIMS, BF16, xla_when_faster=False) is not None


def test_short_k_counts_every_batch_member():
    # 16 x 8192 x 8192 x 128 (attention scores) ran at 0.83x; one 2048 x 4096 x 128 product
    # stays on the kernel.
    assert "at most 128" in gemm_config.xla_reason(8192, 8192, 128, 1e-3, batch=16)
    assert gemm_config.xla_reason(2048, 4096, 128, 1e-3) is None
    assert gemm_config.xla_reason(2048, 4096, 128, 1e-3, batch=2) is not None
    assert gemm_config.xla_reason(8192, 8192, 129, 1e-3, batch=16) is None


@pytest.mark.parametrize("m,n,k", [
    (8192, 8192, 8192), (64, 64, 64), (1, 4096, 4096), (16, 4096, 64), (2048, 4096, 128),
    (3277, 702, 8677),  # A's rows padded (K = 8677), but the product hides the copy: 2.4x XLA
    (74, 1040, 9883),  # A padded: 1.6x
])
def test_products_the_kernel_wins_keep_it(m, n, k):
    a, b = spec((m, k), BF16), spec((k, n), BF16)
    assert gemm.kernel_choice(a, b, gemm_plan.MATMUL_DIMS, BF16, xla_when_faster=True) is not None


@needs_extension
def test_cuda_lowering_leaves_xla_the_products_it_computes_faster(monkeypatch):
    a, b = spec((4096, 32), BF16), spec((32, 4096), BF16)
    cfg = jax_tma.GemmConfig(128, 128, 6, 1)
    monkeypatch.setenv("JAX_TMA_KERNEL_ALWAYS", "0")
    assert gemm.KERNEL_TARGET not in cuda_hlo(lambda x, y: jax_tma.matmul(x, y), a, b)
    assert gemm.KERNEL_TARGET in cuda_hlo(lambda x, y: jax_tma.matmul(x, y, config=cfg), a, b)
    monkeypatch.setenv("JAX_TMA_KERNEL_ALWAYS", "1")
    assert gemm.KERNEL_TARGET in cuda_hlo(lambda x, y: jax_tma.matmul(x, y), a, b)
    monkeypatch.setenv("JAX_TMA_KERNEL_ALWAYS", "sometimes")
    with pytest.raises(ValueError, match="JAX_TMA_KERNEL_ALWAYS='sometimes' is not a boolean"):
        cuda_hlo(lambda x, y: jax_tma.matmul(x, y), a, b)


def test_stream_k_pays_a_fixed_cost_on_few_waves():
    """Stream-K's memset and fixup lost it the products of few waves it was chosen for (H100:
    768 x 384 x 2368 16.3 us against 7.8 for 64 x 64 tiles, 8832 x 64 x 640 10.9 against 7.7 for
    128 x 128 whole); on many waves it keeps its lead (8192^3, 16384 x 4096 x 4096)."""
    h100 = 3.352e12
    for m, n, k in ((768, 384, 2368), (8832, 64, 640), (5312, 256, 1920), (26304, 64, 512)):
        assert not gemm_config.default_config(m, n, k, dram_bytes_per_s=h100).stream_k, (m, n, k)
    for m, n, k in ((8192, 8192, 8192), (16384, 4096, 4096)):
        assert gemm_config.default_config(m, n, k, dram_bytes_per_s=h100).stream_k, (m, n, k)


# ---------------------------------------------------------------- sizes near 2^31 (CPU)
# The CUDA lowering of ShapeDtypeStruct specs needs no memory: each product either runs the
# kernel (within gemm_config.MAX_DIM, MAX_WORK_UNITS and MAX_BUFFER_BYTES, which the FFI
# handler takes) or XLA's dot. None may reach the kernel beyond them (issue 30: a hang on
# k = 2^31 - 1 .. 2^31 - 63, garbage on m or n within a tile of 2^31, run-time errors past).

T31 = 2**31
SIZE_CASES = [
    # (id, function, a shape, b shape, kernel)
    ("1d-k=2^31-1", jax_tma.matmul, (T31 - 1,), (T31 - 1,), True),
    ("1d-k=2^31-63", jax_tma.matmul, (T31 - 63,), (T31 - 63,), True),
    ("1d-k=2^31", jax_tma.matmul, (T31,), (T31,), False),
    ("K=2^31+64", jax_tma.matmul, (2, T31 + 64), (T31 + 64, 8), False),
    ("M-folded-past-2^31", jax_tma.matmul, (2**16, 2**15 + 1, 8), (8, 64), False),
    ("batch=2^31", jax_tma.matmul, (T31, 1, 8), (T31, 8, 1), False),
    ("batch=2^31-1-units", jax_tma.matmul, (T31 - 1, 1, 8), (T31 - 1, 8, 1), False),
    ("2^30-matvecs", jax.vmap(jax_tma.matmul), (2**30, 2, 8), (2**30, 8), False),
    ("2^29-matvecs", jax.vmap(jax_tma.matmul), (2**29, 2, 8), (2**29, 8), True),
    ("m=2^31-1", jax_tma.matmul, (T31 - 1, 8), (8, 64), True),
    ("m=2^31-64", jax_tma.matmul, (T31 - 64, 8), (8, 64), True),
    ("m=2^31", jax_tma.matmul, (T31, 8), (8, 64), False),
    ("n=2^31-1", jax_tma.matmul, (64, 8), (8, T31 - 1), True),
    ("n=2^31", jax_tma.matmul, (64, 8), (8, T31), False),
    ("1TiB-operand", jax_tma.matmul, (2**20, 2**20), (2**20, 8), False),
]


@needs_extension
@pytest.mark.parametrize("fn,a_shape,b_shape,kernel", [c[1:] for c in SIZE_CASES],
                         ids=[c[0] for c in SIZE_CASES])
def test_cuda_lowering_sizes_near_2_31(fn, a_shape, b_shape, kernel):
    hlo = cuda_hlo(fn, spec(a_shape, BF16), spec(b_shape, BF16))
    assert hlo.count(f"custom_call @{gemm.KERNEL_TARGET}(") == int(kernel)
    assert ("stablehlo.dot_general" in hlo) == (not kernel)
    if kernel:  # the attributes carry the sizes whole
        m = a_shape[-2] if len(a_shape) == 2 else 1
        k = a_shape[-1]
        assert f"k = {k} : i64" in hlo
        if m > 1:
            assert f"m = {m} : i64" in hlo


@needs_extension
@pytest.mark.parametrize("a_shape,b_shape", [((2, T31 + 64), (T31 + 64, 8)), ((T31, 8), (8, 64))],
                         ids=["K=2^31+64", "m=2^31"])
def test_cuda_lowering_forced_config_past_max_dim_is_xla(a_shape, b_shape):
    """A config is ignored where the kernel does not apply: sizes past MAX_DIM lower to XLA."""
    cfg = jax_tma.GemmConfig(128, 128, 6, 1, split_k=2)
    hlo = cuda_hlo(functools.partial(jax_tma.matmul, config=cfg), spec(a_shape, BF16), spec(b_shape, BF16))
    assert gemm.KERNEL_TARGET not in hlo and "stablehlo.dot_general" in hlo


def test_sizes_past_the_kernel_limits_plan_to_xla():
    """gemm_plan refuses any size past MAX_DIM and any operand past MAX_BUFFER_BYTES."""
    mm = gemm_plan.MATMUL_DIMS
    assert gemm_plan.plan((1, gemm_config.MAX_DIM), (gemm_config.MAX_DIM, 1), mm) is not None
    assert gemm_plan.plan((1, gemm_config.MAX_DIM + 1), (gemm_config.MAX_DIM + 1, 1), mm) is None
    assert gemm_plan.plan((gemm_config.MAX_DIM + 1, 8), (8, 8), mm) is None
    assert gemm_plan.plan((8, 8), (8, gemm_config.MAX_DIM + 1), mm) is None
    batched = (((2,), (1,)), ((0,), (0,)))
    assert gemm_plan.plan((gemm_config.MAX_DIM + 1, 1, 8), (gemm_config.MAX_DIM + 1, 8, 1), batched) is None
    # 2^39 elements of 16 bits: 2^40 bytes, one TMA stride past the limit.
    assert gemm_plan.plan((2**20, 2**19), (2**19, 8), mm) is None
    assert gemm_plan.plan((2**19, 2**19), (2**19, 8), mm) is not None
    # Padded rows count: 2^39 - 2^19 elements padded by 2^19 * 8 elements is past it.
    assert gemm_plan.plan((2**20, 2**19 - 8), (2**19 - 8, 8), mm) is not None
    assert gemm_plan.plan((2**21, 2**18 - 1), (2**18 - 1, 8), mm) is None


def test_work_units_follow_the_ffi_handler():
    """(cluster rows) x (N blocks) x batch x splits, as csrc/ffi/gemm.cc run() counts them."""
    cfg = jax_tma.GemmConfig(128, 256, 3, 2, split_k=4)
    assert cfg.work_units(129, 257, 64 * 8) == 1 * 2 * 1 * 4  # two M blocks: one cluster row
    assert cfg.work_units(385, 256, 64 * 2, batch=3) == 2 * 1 * 3 * 2  # splits_for(128) == 2
    small = jax_tma.GemmConfig(64, 64, 12, 1)
    assert small.work_units(2**31 - 1, 2**31 - 1, 8) == 2**25 * 2**25
    assert small.work_units(1, 1, 8, batch=2**29) == 2**29


def test_forced_config_past_the_unit_limit_is_a_value_error():
    """A forced config that cuts a product into more units than the scheduler numbers is a
    ValueError naming the shapes at trace time (CPU too); the heuristic then picks another
    configuration, or none (XLA)."""
    batch = 2**29
    a, b = spec((batch, 1, 256), BF16), spec((batch, 256, 1), BF16)
    split = jax_tma.GemmConfig(64, 64, 12, 1, split_k=4)
    assert split.work_units(1, 1, 256, batch) > gemm_config.MAX_WORK_UNITS
    with pytest.raises(ValueError, match=rf"{batch} x \(1, 1\) output, K=256 into {4 * batch} work units"):
        jax.eval_shape(functools.partial(jax_tma.matmul, config=split), a, b)
    with pytest.raises(ValueError, match="work units"):
        gemm_config.check_config(split, 1, 1, 256, BF16, batch=batch)
    picked = gemm_config.default_config(1, 1, 256, batch=batch)
    assert picked is not None and picked.work_units(1, 1, 256, batch) <= gemm_config.MAX_WORK_UNITS
    assert gemm_config.default_config(1, 1, 256, batch=2**30) is None  # one unit per entry is too many
    assert list(gemm_config.legal_configs(1, 1, 256, BF16, batch=2**30)) == []


@needs_extension
def test_cuda_lowering_forced_config_within_the_unit_limit():
    batch = 2**29
    cfg = jax_tma.GemmConfig(64, 64, 12, 1)
    hlo = cuda_hlo(functools.partial(jax_tma.matmul, config=cfg), spec((batch, 1, 256), BF16),
                   spec((batch, 256, 1), BF16))
    assert hlo.count(f"custom_call @{gemm.KERNEL_TARGET}(") == 1
    assert f"batch = {batch} : i64" in hlo


# ---------------------------------------------------------------- jnp.matmul's keywords (CPU)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("kw", [
    dict(precision=jax.lax.Precision.HIGHEST),
    dict(precision="bfloat16"),
    dict(preferred_element_type=np.float32),
    dict(precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32, preferred_element_type=np.float32),
    dict(precision=jax.lax.DotAlgorithmPreset.F16_F16_F16),
], ids=["highest", "bf16-string", "preferred-f32", "bf16-preset-f32", "f16-preset"])
def test_matmul_takes_jnp_matmul_keywords(rng, kw):
    a, b = random_array(rng, (3, 16, 32), BF16), random_array(rng, (32, 24), BF16)
    out, ref = jax_tma.matmul(a, b, **kw), jnp.matmul(a, b, **kw)
    assert (out.shape, out.dtype) == (ref.shape, ref.dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(ref, np.float64))


def test_matmul_out_dtype_is_preferred_element_type():
    a = jnp.ones((8, 8), BF16)
    assert jax_tma.matmul(a, a, out_dtype=np.float32, preferred_element_type=np.float32).dtype == np.float32
    with pytest.raises(ValueError, match="out_dtype is another name for preferred_element_type"):
        jax_tma.matmul(a, a, out_dtype=np.float32, preferred_element_type=BF16)


@pytest.mark.parametrize("bad", [[1.0, 2.0], "ab", None, object()], ids=["list", "str", "none", "object"])
def test_non_array_operands_raise_jnp_errors(bad):
    b = jnp.ones((2,), BF16)
    with pytest.raises(Exception) as ref:
        jnp.matmul(bad, b)
    with pytest.raises(type(ref.value)) as ours:
        jax_tma.matmul(bad, b)
    assert str(ours.value) == str(ref.value)
    assert "functools.partial" not in str(ours.value)


# ---------------------------------------------------------------- GemmConfig (CPU)


@pytest.mark.parametrize("field,value", [
    ("split_k", True), ("split_k", 2.0), ("block_m", 128.0), ("block_n", "256"), ("stages", np.float32(3)),
    ("cluster_m", np.bool_(True)), ("split_k", None),
])
def test_config_rejects_non_integers(field, value):
    with pytest.raises(ValueError, match=rf"GemmConfig {field} must be an int, got"):
        dataclasses.replace(jax_tma.GemmConfig(), **{field: value})


def test_config_converts_numpy_integers_and_bools():
    cfg = jax_tma.GemmConfig(np.int64(128), np.int32(128), np.uint8(6), np.int16(1), split_k=np.int64(2))
    assert cfg == jax_tma.GemmConfig(128, 128, 6, 1, split_k=2)
    assert all(type(v) is int for v in (cfg.block_m, cfg.block_n, cfg.stages, cfg.cluster_m, cfg.split_k))
    assert hash(cfg) == hash(jax_tma.GemmConfig(128, 128, 6, 1, split_k=2))
    sk = jax_tma.GemmConfig(128, 128, 6, 1, stream_k=np.bool_(True))
    assert sk.stream_k is True and sk == jax_tma.GemmConfig(128, 128, 6, 1, stream_k=True)


def _fresh_gemm_config_module():
    """jax_tma/gemm_config.py loaded again as a new module: what importlib.reload leaves behind
    (another GemmConfig class), without touching the module everything else imported."""
    import importlib.util
    import sys

    from jax_tma.ops.gemm import config as gemm_config

    name = "jax_tma_gemm_config_copy"
    spec_ = importlib.util.spec_from_file_location(name, gemm_config.__file__)
    module = importlib.util.module_from_spec(spec_)
    sys.modules[name] = module  # dataclasses look the module up while building the class
    try:
        spec_.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_config_from_a_reloaded_module_is_accepted():
    other = _fresh_gemm_config_module().GemmConfig(128, 128, 6, 1, split_k=2)
    assert type(other) is not jax_tma.GemmConfig
    a, b = jnp.ones((64, 256), BF16), jnp.ones((256, 32), BF16)
    np.testing.assert_array_equal(np.asarray(jax_tma.matmul(a, b, config=other), np.float32), 256.0)
    out = jax_tma.dot_general(a, b, gemm_plan.MATMUL_DIMS, config=other)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 256.0)
    with pytest.raises(TypeError, match="config must be a jax_tma.GemmConfig or None"):
        jax_tma.matmul(a, b, config=jax_tma.KernelStatus(True, "", ""))


@needs_extension
def test_cuda_lowering_config_from_a_reloaded_module():
    other = _fresh_gemm_config_module().GemmConfig(128, 128, 6, 1, split_k=2)
    hlo = cuda_hlo(functools.partial(jax_tma.matmul, config=other), spec((512, 1024), BF16),
                   spec((1024, 512), BF16))
    for attr in ("block_m = 128", "block_n = 128", "stages = 6", "cluster_m = 1", "splits = 2"):
        assert attr in hlo, attr


# ---------------------------------------------------------------- JAX_TMA_DISABLE (CPU)


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " yes ", "on", "Y", "t"])
def test_disable_true_spellings(monkeypatch, value):
    monkeypatch.setenv("JAX_TMA_DISABLE", value)
    assert _ext.disabled_by_env()
    assert _ext.cuda_lowering_blocker() == "JAX_TMA_DISABLE is set"


@pytest.mark.parametrize("value", ["", "0", "false", "False", " no", "off", "OFF", "n", "f"])
def test_disable_false_spellings(monkeypatch, value):
    monkeypatch.setenv("JAX_TMA_DISABLE", value)
    assert not _ext.disabled_by_env()


@pytest.mark.parametrize("value", ["2", "maybe", "disable", "-1", "yes please"])
def test_disable_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("JAX_TMA_DISABLE", value)
    with pytest.raises(ValueError, match=r"JAX_TMA_DISABLE=.* is not a boolean: use one of 1, true"):
        _ext.disabled_by_env()
    with pytest.raises(ValueError, match="JAX_TMA_DISABLE"):
        jax_tma.kernel_status()


@needs_extension
@pytest.mark.parametrize("value,kernel", [("off", True), ("n", True), ("0", True), ("on", False), ("y", False)])
def test_cuda_lowering_follows_disable_spellings(monkeypatch, value, kernel):
    monkeypatch.setenv("JAX_TMA_DISABLE", value)
    # A new function each time: jax caches lowerings by the traced function.
    hlo = cuda_hlo(lambda a, b: jax_tma.matmul(a, b), spec((64, 32), BF16), spec((32, 64), BF16))
    assert (gemm.KERNEL_TARGET in hlo) == kernel


def test_bad_disable_value_imports_and_raises_at_the_first_op():
    """Importing jax_tma never fails on the variable; the first op names it."""
    import subprocess
    import sys

    code = ("import jax.numpy as jnp, jax_tma\n"
            "try:\n"
            "    jax_tma.matmul(jnp.ones((8, 8), jnp.bfloat16), jnp.ones((8, 8), jnp.bfloat16))\n"
            "except ValueError as e:\n"
            "    print('raised:', e)\n")
    env = dict(os.environ, JAX_TMA_DISABLE="sometimes", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "raised: JAX_TMA_DISABLE='sometimes' is not a boolean" in run.stdout


# ---------------------------------------------------------------- jax.export (CPU)


def _export(fn, platforms, *specs):
    return jax.export.export(jax.jit(fn), platforms=platforms,
                             disabled_checks=jax_tma.export_disabled_checks())(*specs)


@pytest.mark.smoke
def test_export_needs_the_documented_checks():
    specs = (spec((64, 32), BF16), spec((32, 48), BF16))
    names = {str(c) for c in jax_tma.export_disabled_checks()}
    assert {f"custom_call:{t}" for t in gemm.FFI_TARGETS} <= names
    assert all(name.startswith("custom_call:jax_tma_") for name in names)
    if _ext._C is not None:  # every target the extension registers and its "_into" variant
        targets = _ext._C.registrations()
        assert names == {f"custom_call:{t}{v}" for t in targets for v in ("", "_into")}
    if _ext.extension_error() is None:
        with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
            jax.export.export(jax.jit(jax_tma.matmul), platforms=("cuda",))(*specs)


@needs_extension
@pytest.mark.parametrize("platforms", [("cuda",), ("cpu", "cuda")])
def test_export_for_cuda_holds_the_kernel(platforms):
    exported = _export(lambda a, b: jax_tma.matmul(a, b) * 2, platforms, spec((64, 32), BF16), spec((32, 48), BF16))
    assert exported.mlir_module().count(f"custom_call @{gemm.KERNEL_TARGET}(") == 1
    if importlib_util_find("flatbuffers"):
        again = jax.export.deserialize(exported.serialize())
        assert again.mlir_module().count(f"custom_call @{gemm.KERNEL_TARGET}(") == 1
        assert again.platforms == platforms


def importlib_util_find(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("platforms", [("cpu",), ("cpu", "cuda")])
@pytest.mark.parametrize("a_shape,b_shape", [((64, 32), (32, 48)), ((3, 7, 30), (30, 5)), ((2, 16, 8), (2, 8, 24))])
def test_export_round_trip_matches_lax(rng, platforms, a_shape, b_shape):
    """Exported (and, where flatbuffers is installed, serialized and read back), then run on the
    CPU: jnp.matmul's bits. The CUDA branch of a multi-platform module holds the kernel."""
    if "cuda" in platforms and _ext.extension_error() is not None:
        pytest.skip("extension not built")
    a, b = random_array(rng, a_shape, BF16), random_array(rng, b_shape, BF16)
    exported = _export(jax_tma.matmul, platforms, spec(a_shape, BF16), spec(b_shape, BF16))
    if importlib_util_find("flatbuffers"):
        exported = jax.export.deserialize(exported.serialize())
    out = exported.call(a, b)
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(jnp.matmul(a, b), np.float64))


@pytest.mark.usefixtures("on_cpu")
def test_export_of_a_sharded_function(rng):
    """custom_partitioning cannot be serialized: an exported module holds the product itself
    and XLA partitions it; the result keeps its sharding and lax's values."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if len(jax.devices("cpu")) < 2:
        pytest.skip("needs 2 CPU devices")
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x", None))
    f = jax.jit(jax_tma.matmul, in_shardings=(rows, None), out_shardings=rows)
    exported = jax.export.export(f, platforms=("cpu",), disabled_checks=jax_tma.export_disabled_checks())(
        jax.ShapeDtypeStruct((64, 32), BF16, sharding=rows), spec((32, 48), BF16))
    a, b = random_array(rng, (64, 32), BF16), random_array(rng, (32, 48), BF16)
    out = exported.call(jax.device_put(a, rows), b)
    assert out.sharding.spec == rows.spec
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(jnp.matmul(a, b), np.float64))


# ---------------------------------------------------------------- the kernel at scale (Hopper GPU)


def _run_python(code: str, timeout_s: float = 240, **env) -> str:
    """Runs `code` in a fresh Python process (the same interpreter and environment, plus `env`)
    and returns its stdout. A kernel that hangs fails the test at the timeout instead of
    stalling the run."""
    import subprocess
    import sys

    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timeout_s, env={**os.environ, **env})
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"no result within {timeout_s} s (a hang?): {err.stdout!r} {err.stderr!r}")
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


_DETERMINISM_SCRIPT = r"""
import hashlib, jax, jax.numpy as jnp, numpy as np
import jax_tma
from jax_tma import _testing
cases = [
    ((1000, 576), (576, 4096), None),
    ((4097, 8192), (8192, 129), jax_tma.GemmConfig(128, 128, 6, 1, split_k=4)),
    ((2048, 4096), (4096, 2048), jax_tma.GemmConfig(128, 256, 3, 1, stream_k=True)),
    ((777, 3000), (3000, 1232), jax_tma.GemmConfig(64, 128, 8, 2)),
    ((512, 65536), (65536, 512), None),
]
rng = np.random.default_rng(1234)
for a_shape, b_shape, config in cases:
    a = rng.standard_normal(a_shape, dtype=np.float32).astype(jnp.bfloat16)
    b = rng.standard_normal(b_shape, dtype=np.float32).astype(jnp.bfloat16)
    for out_dtype in (jnp.bfloat16, jnp.float32):
        f = jax.jit(lambda a, b: jax_tma.matmul(a, b, preferred_element_type=out_dtype, config=config))
        hlo = f.lower(a, b).compile().as_text()
        assert "jax_tma_gemm_sm90" in hlo, (a_shape, b_shape, config)
        first = np.asarray(f(a, b)).tobytes()
        assert np.asarray(f(a, b)).tobytes() == first  # the same bits within the process too
        print(a_shape, b_shape, config, jnp.dtype(out_dtype).name, hashlib.sha256(first).hexdigest())
"""


@pytest.mark.gpu
def test_kernel_is_bitwise_deterministic_across_processes():
    """Two processes, the same operands: the same output bits for every configuration kind
    (heuristic, split-K, stream-K, 64-row clusters, the heuristic's split-K on a long K), bf16
    and fp32 outputs."""
    first = _run_python(_DETERMINISM_SCRIPT)
    second = _run_python(_DETERMINISM_SCRIPT)
    assert first.count("\n") == 10
    assert first == second


_PAST_2_31_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
import jax_tma
from jax_tma import _testing
config = {config}
m, n, k = 65536, 40000, 256
key_a, key_b = jax.random.split(jax.random.key(7))
a = jax.random.normal(key_a, (m, k), jnp.float32).astype(jnp.bfloat16)
b = jax.random.normal(key_b, (k, n), jnp.float32).astype(jnp.bfloat16)
out = _testing.gemm_poisoned(a, b, jnp.bfloat16, config=config)
assert out.shape == (m, n) and out.size > 2**31
assert not bool(jnp.isnan(out).any()), "kernel left poisoned (unwritten) outputs"
rows = np.unique([0, 1, 127, 128, m // 2, 2**31 // n - 1, 2**31 // n, 2**31 // n + 1, m - 129,
                  m - 2, m - 1])
cols = np.unique([0, 1, 255, 256, n // 2, 2**31 % n, n - 257, n - 2, n - 1])
a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
def rel(x, ref):
    return np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref)
print(f"{{rel(out[rows], a64[rows] @ b64):.3e}} {{rel(out[:, cols], a64 @ b64[:, cols]):.3e}}")
"""


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    ["None", "jax_tma.GemmConfig(128, 128, 6, 1, split_k=2)",
     "jax_tma.GemmConfig(128, 256, 3, 1, stream_k=True)"],
    ids=["default", "split2", "stream_k"],
)
def test_kernel_output_past_2_31_elements(config):
    """65536 x 40000 bf16 (2.6e9 elements, 5.2 GB) over a NaN-filled output: every element
    written (checked on the device), and sampled rows and columns, the last ones and those
    around element 2^31, within the bf16 bound of a float64 reference. In a subprocess: XLA's
    allocator keeps what a process once held, and the 2^31 tests below need most of the GPU."""
    out = _run_python(_PAST_2_31_SCRIPT.format(config=config), timeout_s=300)
    errors = [float(e) for e in out.strip().splitlines()[-1].split()]
    assert len(errors) == 2 and max(errors) <= TOL[BF16], out


_NEAR_2_31_SCRIPT = r"""
import functools
import jax, jax.numpy as jnp, numpy as np
import jax_tma
from jax_tma import _testing
from jax_tma.ops.gemm import config as gemm_config
from jax_tma.ops.gemm import plan as gemm_plan
from jax_tma.ops.gemm import primitive as gemm
case = {case!r}
T = 2**31

@functools.partial(jax.jit, static_argnums=(0, 1))
def small_ints(shape, salt):
    # Integers in [-2, 2] from a hash of the indices (no random bits past 2^32 elements).
    h = jnp.uint32(salt)
    for axis in range(len(shape)):
        h = h * jnp.uint32(2654435761) + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    h = (h ^ (h >> 15)) * jnp.uint32(2246822519)
    return ((h >> 13) % 5).astype(jnp.int32).astype(jnp.bfloat16) - 2

if case.startswith("k="):  # a 1-D dot of k elements
    k = T - int(case[len("k=2^31-"):])
    a, b = small_ints((k,), 1), small_ints((k,), 2)
    f = jax.jit(lambda a, b: jax_tma.matmul(a, b, preferred_element_type=jnp.float32))
    assert gemm.KERNEL_TARGET in f.lower(a, b).compile().as_text()
    got = float(f(a, b))
    want = int(jax.jit(lambda a, b: jnp.sum(a.astype(jnp.int32) * b.astype(jnp.int32)))(a, b))
    print("ok" if got == want else f"got {{got}}, want {{want}}")
    raise SystemExit
f32 = jnp.float32
if case == "m=2^31-1":  # [m, 8] @ [8, 1]
    a, b = small_ints((T - 1, 8), 1), small_ints((8, 1), 2)
    dims = (((1,), (0,)), ((), ()))
    # A fused multiply-reduce: no fp32 copy of the 32 GiB operand.
    reference = jax.jit(lambda a, b: jnp.sum(a.astype(f32) * b[:, 0].astype(f32), axis=1)[:, None])
else:  # "n=2^31-1": [1, 8] . [n, 8]^T, B stored K-major (rows of 16 bytes)
    a, b = small_ints((1, 8), 1), small_ints((T - 1, 8), 2)
    dims = (((1,), (1,)), ((), ()))
    reference = jax.jit(lambda a, b: jnp.sum(a[0].astype(f32) * b.astype(f32), axis=1)[None, :])
out = _testing.gemm_poisoned(a, b, jnp.bfloat16, dimension_numbers=dims)
assert not bool(jnp.isnan(out).any()), "unwritten outputs"
# Sums of 8 products of integers in [-2, 2]: exact in bf16 and fp32. Compared in 8 slices of
# the long operand, so that no temporary of its size joins the 32 GiB operand in memory.
wrong, step = 0, -(-(T - 1) // 8)
count = jax.jit(lambda out, ref: jnp.sum(out.astype(f32) != ref))
for i in range(0, T - 1, step):
    if case == "m=2^31-1":
        wrong += int(count(out[i:i + step], reference(a[i:i + step], b)))
    else:
        wrong += int(count(out[:, i:i + step], reference(a, b[i:i + step])))
f = jax.jit(lambda a, b: jax_tma.dot_general(a, b, dims))
assert gemm.KERNEL_TARGET in f.lower(a, b).compile().as_text()
print("ok" if wrong == 0 else f"{{wrong}} wrong elements")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["k=2^31-1", "k=2^31-63", "m=2^31-1", "n=2^31-1"])
def test_kernel_sizes_near_2_31(case):
    """Issue 30's hang (k in [2^31 - 63, 2^31 - 1]) and garbage (m or n within a tile of 2^31):
    in a subprocess with a timeout, integer-valued operands so the result is exact. The m and
    n cases hold a 32 GiB operand (about 45 GiB of GPU memory in all)."""
    # XLA's allocator takes 75 % of the GPU by default: the 32 GiB operand, the output and a
    # slice of the reference need more on an 80 GB H100.
    out = _run_python(_NEAR_2_31_SCRIPT.format(case=case), timeout_s=300,
                      XLA_PYTHON_CLIENT_MEM_FRACTION="0.92")
    assert out.strip().splitlines()[-1] == "ok", out
