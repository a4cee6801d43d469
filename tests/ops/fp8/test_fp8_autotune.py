"""jax_tma.fp8_autotune: the cache key, the tuning flow with a stand-in timer (the winner is
stored, a cached key is not re-timed, stale entries are ignored), JAX_TMA_AUTOTUNE=1 tuning at
trace time, the CUDA lowering reading the cache, and a real tuning run on a Hopper GPU."""

from __future__ import annotations

import dataclasses
import json

import jax
import ml_dtypes
import numpy as np
import pytest

import jax_tma
from jax_tma import _ext
from jax_tma._core import tuning_cache
from jax_tma.ops.fp8 import autotune as tuner
from jax_tma.ops.fp8 import config as fp8_config
from jax_tma.ops.fp8 import tuned
from support import cuda_hlo, fake_tuning_device, needs_extension, rel_error

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
NT = (((1,), (1,)), ((), ()))


def spec(shape, dtype=E4M3):
    return jax.ShapeDtypeStruct(shape, dtype)


def block_specs(m, n, k):
    """lhs [M, K], rhs [N, K] and their 1 x 128 / 128 x 128 scales."""
    kb = -(-k // 128)
    return spec((m, k)), spec((n, k)), spec((kb, m), F32), spec((kb, -(-n // 128)), F32)


def product(m, n, k, promote=True, block=True, out=BF16):
    return tuned.Product(m, n, k, E4M3, np.dtype(out), promote, block)


@pytest.fixture(autouse=True)
def cache_file(autotune_cache):
    """Every test gets its own cache file (conftest's autotune_cache)."""
    return autotune_cache


def test_key_names_device_types_accumulation_scales_and_shape():
    assert product(256, 512, 1024).key("NVIDIA H200") == (
        "NVIDIA H200|fp8|float8_e4m3fn|bfloat16|promoted|block|m256n512k1024")
    assert product(256, 512, 1024, promote=False, block=False, out=F32).key("X") == (
        "X|fp8|float8_e4m3fn|float32|fast|tensor|m256n512k1024")


def test_autotune_needs_the_kernels(monkeypatch):
    monkeypatch.setattr(_ext, "kernel_status",
                        lambda: _ext.KernelStatus(False, "no GPU in this test", None))
    with pytest.raises(RuntimeError, match="no GPU in this test"):
        jax_tma.fp8_autotune(*block_specs(256, 256, 256))
    with pytest.raises(ValueError, match="max_candidates must be a positive int"):
        jax_tma.fp8_autotune(*block_specs(256, 256, 256), max_candidates=0)


@pytest.fixture
def fake_device(monkeypatch):
    """A stand-in timer that makes the 128 x 128 tile without a cluster the fastest
    configuration: not the heuristic's pick for the products below."""
    return fake_tuning_device(monkeypatch, tuner, ((128, 128, 5, 1), 1))


def test_autotune_stores_the_winner_and_reuses_it(fake_device, cache_file):
    m, n, k = 4096, 2048, 1024
    result = jax_tma.fp8_autotune(*block_specs(m, n, k))
    assert (result.best.tile, result.best.split_k) == ((128, 128, 5, 1), 1)
    assert result.default == fp8_config.default_config(m, n, k) != result.best
    assert len(fake_device) == 1 and result.default in fake_device[0]
    assert fake_device[0] == product(m, n, k).candidates() and result.speedup >= 2.0
    assert tuned.lookup(product(m, n, k)) == result.best
    assert tuned.lookup(product(m, n, k, block=False)) is None  # another key
    again = jax_tma.fp8_autotune(*block_specs(m, n, k))
    assert again.best == result.best and len(fake_device) == 1  # cached: not re-timed
    jax_tma.fp8_autotune(*block_specs(m, n, k), force=True)
    assert len(fake_device) == 2
    entry = json.loads(cache_file.read_text())["entries"][result.key]
    assert entry["seconds"][result.best.describe()] == 1e-3
    # The other operand layout of the same product, and max_candidates.
    a, b, sa, sb = block_specs(m, n, k)
    lhs_t = spec((k, m))
    jax_tma.fp8_autotune(lhs_t, b, spec((1, 1), F32), spec((1, 1), F32),
                         (((0,), (1,)), ((), ())), max_candidates=3, force=True)
    assert len(fake_device[-1]) == 3
    assert tuned.lookup(product(m, n, k, block=False)) is not None


def test_candidates_include_tiles_the_heuristic_has_no_rate_for(monkeypatch):
    # A compiled tile whose rate is not yet measured (here: the fast 128 x 256 pairs' rate
    # taken away) is timed too, after the ones the heuristic ranks.
    monkeypatch.delitem(fp8_config._FAST_EFFICIENCY, (128, 256, 2))
    fast = product(4096, 2112, 7168, promote=False, block=False).candidates()
    assert fast[0] == fp8_config.default_config(4096, 2112, 7168, fast=True)
    unrated = [c for c in fast if fp8_config.rate_key(c.tile) == (128, 256, 2)]
    assert [c.tile for c in unrated] == [(128, 256, 3, 2)]
    assert fast[-1] in unrated or fast[-1].stream_k
    assert fast.index(unrated[0]) > max(
        i for i, c in enumerate(fast) if fp8_config.rate_key(c.tile) in
        fp8_config._FAST_EFFICIENCY and not c.stream_k)


def test_calls_the_kernel_does_not_compute_are_refused(fake_device):
    # rhs with (1, 128) scales (one per column and K block): the kernel takes 128 x 128 only.
    with pytest.raises(ValueError, match=r"does not compute .* \(it runs on XLA\)"):
        jax_tma.fp8_autotune(spec((256, 512)), spec((384, 512)), spec((4, 256), F32),
                             spec((4, 384), F32))
    assert not fake_device


def test_calls_on_xla_are_refused(fake_device, monkeypatch):
    """Mixed FP8 types (XLA's reference runs them), and the kernel switched off."""
    m, n, k = 256, 384, 512
    a, b, sa, sb = block_specs(m, n, k)
    with pytest.raises(ValueError, match=r"float8_e4m3fn x \(384, 512\) float8_e5m2"):
        jax_tma.fp8_autotune(a, spec((n, k), np.dtype(ml_dtypes.float8_e5m2)), sa, sb)
    monkeypatch.setenv("JAX_TMA_FP8_KERNEL", "0")
    with pytest.raises(ValueError, match="it runs on XLA"):
        jax_tma.fp8_autotune(a, b, sa, sb)
    assert not fake_device


def test_autotune_keeps_its_own_settings_under_the_env(fake_device, monkeypatch):
    """With JAX_TMA_AUTOTUNE=1, finding the product (a trace) does not tune it first."""
    monkeypatch.setenv("JAX_TMA_AUTOTUNE", "1")
    jax_tma.fp8_autotune(*block_specs(2048, 2048, 2048), max_candidates=2)
    assert [len(c) for c in fake_device] == [2]


def test_env_does_not_tune_vmapped_calls(fake_device, monkeypatch):
    monkeypatch.setenv("JAX_TMA_AUTOTUNE", "1")
    a, b, sa, sb = block_specs(512, 1024, 1024)
    batched = (spec((4, 512, 1024)), b, spec((4, *sa.shape), F32), sb)
    jax.jit(jax.vmap(lambda *o: jax_tma.fp8_dot_general(*o, NT),
                     in_axes=(0, None, 0, None))).trace(*batched)
    assert not fake_device


def test_stale_or_foreign_entries_are_ignored():
    p = product(8192, 8192, 8192)
    for config in ({"block_m": 128, "block_n": 176, "stages": 4, "cluster_m": 2, "split_k": 1,
                    "stream_k": False},
                   {"block_m": 128, "block_n": 192, "stages": 4, "cluster_m": 2, "split_k": 4,
                    "stream_k": False},
                   {"block_m": 128, "block_n": 128, "stages": 5, "cluster_m": 1, "split_k": 1,
                    "stream_k": False, "extra": 1},
                   {"block_m": 128}, "not a dict"):
        tuning_cache.store(p.key(), {"config": config})
        assert tuned.lookup(p) is None, config
        assert tuned.config_for(p) == fp8_config.default_config(8192, 8192, 8192)
    good = fp8_config.Fp8Config(128, 128, 5, 1)
    tuning_cache.store(p.key(), {"config": dataclasses.asdict(good)})
    assert tuned.lookup(p) == good == tuned.config_for(p)
    # An entry written before stream_k existed runs without it.
    old = {k: v for k, v in dataclasses.asdict(good).items() if k != "stream_k"}
    tuning_cache.store(p.key(), {"config": old})
    assert tuned.lookup(p) == good


def test_env_tunes_at_trace_time(fake_device, monkeypatch):
    monkeypatch.setenv("JAX_TMA_AUTOTUNE", "1")
    m, n, k = 2048, 1536, 4096
    fn = jax.jit(lambda *a: jax_tma.fp8_dot_general(*a, NT))
    fn.trace(*block_specs(m, n, k))
    assert len(fake_device) == 1 and tuned.lookup(product(m, n, k)) is not None
    jax.jit(lambda *a: jax_tma.fp8_dot_general(*a, NT) * 2).trace(*block_specs(m, n, k))
    assert len(fake_device) == 1  # the key is cached now
    # An explicit config is not tuned; JAX_TMA_AUTOTUNE=0 tunes nothing.
    cfg = fp8_config.Fp8Config(128, 256, 3, 2)
    jax.jit(lambda *a: jax_tma.fp8_dot_general(*a, NT, config=cfg)).trace(
        *block_specs(m, n, 2 * k))
    monkeypatch.setenv("JAX_TMA_AUTOTUNE", "0")
    fn.trace(*block_specs(m, n, 3 * k))
    assert len(fake_device) == 1


@needs_extension
def test_cuda_lowering_reads_the_cache():
    m, n, k = 8192, 4096, 1024
    cfg = fp8_config.Fp8Config(128, 128, 5, 1)
    assert fp8_config.default_config(m, n, k) != cfg  # not what the heuristic picks
    tuning_cache.store(product(m, n, k).key(), {"config": dataclasses.asdict(cfg)})
    hlo = cuda_hlo(lambda *a: jax_tma.fp8_dot_general(*a, NT), *block_specs(m, n, k))
    for attr in ("block_m = 128", "block_n = 128", "stages = 5", "cluster_m = 1", "splits = 1"):
        assert attr in hlo, attr
    # Per-tensor scales are another key: the heuristic's tile.
    hlo = cuda_hlo(lambda a, b: jax_tma.fp8_dot_general(a, b, 1.0, 1.0, NT),
                   spec((m, k)), spec((n, k)))
    assert f"block_n = {fp8_config.default_config(m, n, k).block_n}" in hlo


@pytest.mark.gpu
def test_autotune_on_the_device(rng):
    m, n, k = 1000, 1536, 2048
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)
    a, sa = jax_tma.quantize_fp8(x, (1, 128))
    b, sb = jax_tma.quantize_fp8(w, (128, 128))
    result = jax_tma.fp8_autotune(a, b, sa, sb, rounds=1, sets=1)
    assert result.best.describe() in result.seconds and len(result.seconds) > 3
    assert all(0 < s < 1 for s in result.seconds.values())
    assert result.seconds[result.best.describe()] == min(result.seconds.values())
    assert tuned.lookup(product(m, n, k)) == result.best
    out = jax.jit(lambda *o: jax_tma.fp8_dot_general(*o, NT))(a, b, sa, sb)
    ref = (np.asarray(a, np.float64) * np.repeat(np.asarray(sa, np.float64).T, 128, 1)[:, :k]) @ (
        np.asarray(b, np.float64) * np.repeat(np.repeat(np.asarray(sb, np.float64).T, 128, 0),
                                              128, 1)[:n, :k]).T
    assert rel_error(out, ref) <= 1e-2
