"""jax_tma.autotune and the autotuning cache: the switch, the cache file (location, round trip,
concurrent writers, stale entries), the tuning flow with a stand-in timer (which configuration
wins is stored, a cached key is not re-timed), JAX_TMA_AUTOTUNE=1 tuning at trace time, the
CUDA lowering reading the cache, and a real tuning run on a Hopper GPU."""

from __future__ import annotations

import dataclasses
import json
from unittest import mock
import multiprocessing
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_tma
from jax_tma import _ext
from jax_tma._core import tuning_cache
from jax_tma.ops.gemm import autotune as tuner
from jax_tma.ops.gemm import config as gemm_config
from jax_tma.ops.gemm import primitive as gemm
from jax_tma.ops.gemm import tuned
from support import REPO, cuda_hlo, fake_tuning_device, needs_extension, rel_error
BF16 = np.dtype(ml_dtypes.bfloat16)
MATMUL = (((1,), (0,)), ((), ()))


def spec(shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture(autouse=True)
def cache_file(autotune_cache):
    """Every test gets its own cache file (conftest's autotune_cache)."""
    return autotune_cache


def _plan(m, n, k):
    route = gemm.kernel_route(spec((m, k)), spec((k, n)), MATMUL, BF16)
    assert route is not None
    return route.plan


def test_switch(monkeypatch):
    assert not tuner.enabled()
    for value, on in (("1", True), ("yes", True), ("ON", True), ("0", False), ("off", False)):
        monkeypatch.setenv("JAX_TMA_AUTOTUNE", value)
        assert tuner.enabled() is on
    monkeypatch.setenv("JAX_TMA_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="JAX_TMA_AUTOTUNE='sometimes'"):
        tuner.enabled()


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_TMA_AUTOTUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning_cache.cache_path() == tmp_path / "xdg" / "jax_tma" / "autotune.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning_cache.cache_path() == tmp_path / "home" / ".cache" / "jax_tma" / "autotune.json"


def test_key_names_device_dtypes_layout_and_shape():
    plan = _plan(1000, 3000, 777)
    key = tuned.cache_key(plan, BF16, jnp.float32, device_kind="NVIDIA H100 80GB HBM3")
    assert key.startswith("NVIDIA H100 80GB HBM3|bfloat16|float32|NN|")
    assert "b1m1000n3000k777" in key and "misaligned=b" in key  # B rows: 6000 bytes
    transposed = gemm.kernel_route(spec((777, 1000)), spec((3000, 777)),
                                   (((0,), (1,)), ((), ())), BF16).plan
    assert tuned.cache_key(transposed, BF16, BF16, "x").split("|")[3] == "TT"
    assert len({tuned.cache_key(_plan(*s), BF16, BF16, "x")
                for s in [(64, 64, 64), (64, 64, 128), (64, 128, 64), (128, 64, 64)]}) == 4


def test_store_and_lookup_round_trip(cache_file):
    plan = _plan(512, 1024, 2048)
    assert tuned.lookup(plan, BF16, BF16) is None and not cache_file.exists()
    cfg = jax_tma.GemmConfig(block_m=128, block_n=128, stages=6, cluster_m=1, split_k=2)
    tuning_cache.store(tuned.cache_key(plan, BF16, BF16), {"config": dataclasses.asdict(cfg)})
    assert tuned.lookup(plan, BF16, BF16) == cfg
    assert tuned.lookup(plan, BF16, jnp.float32) is None  # another key
    data = json.loads(cache_file.read_text())
    assert data["version"] == tuning_cache.CACHE_VERSION and len(data["entries"]) == 1


def test_stale_or_foreign_entries_are_ignored(cache_file):
    plan = _plan(512, 1024, 2048)
    key = tuned.cache_key(plan, BF16, BF16)
    # A tile that is not compiled, and a split that the product's K cannot use.
    tuning_cache.store(key, {"config": {"block_m": 96, "block_n": 128, "stages": 6, "cluster_m": 1}})
    assert tuned.lookup(plan, BF16, BF16) is None
    tuning_cache.store(key, {"config": {"block_m": 128, "block_n": 128, "stages": 6,
                                      "cluster_m": 1, "split_k": 8}})
    small = _plan(512, 1024, 64)
    tuning_cache.store(tuned.cache_key(small, BF16, BF16),
                     {"config": {"block_m": 128, "block_n": 128, "stages": 6, "cluster_m": 1,
                                 "split_k": 8}})
    assert tuned.lookup(small, BF16, BF16) is None
    # Another version's file: no entries, rewritten by the next store.
    cache_file.write_text(json.dumps({"version": 0, "entries": {key: {}}}))
    assert tuning_cache.entries() == {}
    cache_file.write_text("{not json")
    with pytest.raises(RuntimeError, match="cannot be read"):
        tuning_cache.entries()


def _writer(args):
    path, worker, count = args
    os.environ["JAX_TMA_AUTOTUNE_CACHE"] = path
    for i in range(count):
        tuning_cache.store(f"worker{worker}-{i}", {"config": {"i": i}})


def test_concurrent_writers_lose_nothing(cache_file):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(6) as pool:
        pool.map(_writer, [(str(cache_file), w, 15) for w in range(6)])
    entries = json.loads(cache_file.read_text())["entries"]
    assert set(entries) == {f"worker{w}-{i}" for w in range(6) for i in range(15)}
    assert not [p for p in cache_file.parent.iterdir() if p.name.startswith("autotune.json.")
                and not p.name.endswith(".lock")]  # no temporary file left behind


def test_autotune_needs_the_kernels(monkeypatch):
    monkeypatch.setattr(_ext, "kernel_status",
                        lambda: _ext.KernelStatus(False, "no GPU in this test", None))
    with pytest.raises(RuntimeError, match="no GPU in this test"):
        jax_tma.autotune(spec((256, 256)), spec((256, 256)))
    with pytest.raises(ValueError, match="must be 2-D"):
        jax_tma.autotune(spec((2, 256, 256)), spec((256, 256)))


@pytest.fixture
def fake_device(monkeypatch):
    """A stand-in timer that makes 128 x 128, 6 stages, split 2 the fastest configuration and
    gives XLA's dot 5 ms (settable: fake_device.xla_s)."""
    return fake_tuning_device(monkeypatch, tuner, ((128, 128, 6, 1), 2), xla_s=5e-3)


def test_autotune_stores_the_winner_and_reuses_it(fake_device, cache_file):
    result = jax_tma.autotune(spec((512, 4096)), spec((4096, 1024)))
    assert (result.best.tile, result.best.split_k) == ((128, 128, 6, 1), 2)
    assert len(fake_device) == 1 and len(fake_device[0]) > 5
    assert result.default in fake_device[0] and result.speedup >= 2.0
    plan = _plan(512, 1024, 4096)
    assert tuned.lookup(plan, BF16, BF16) == result.best
    again = jax_tma.autotune(spec((512, 4096)), spec((4096, 1024)))
    assert again.best == result.best and len(fake_device) == 1  # cached: not re-timed
    jax_tma.autotune(spec((512, 4096)), spec((4096, 1024)), force=True)
    assert len(fake_device) == 2
    entry = json.loads(cache_file.read_text())["entries"][result.key]
    assert entry["seconds"][result.best.describe()] == 1e-3
    assert entry["xla_seconds"] == 5e-3 and not result.xla_faster


def _choice(m, n, k):
    return gemm.kernel_choice(spec((m, k)), spec((k, n)), MATMUL, BF16)


def test_xla_measured_faster_takes_the_product(fake_device, monkeypatch):
    monkeypatch.delenv("JAX_TMA_KERNEL_ALWAYS", raising=False)
    assert _choice(512, 1024, 4096) is not None  # the rule keeps the kernel
    fake_device.xla_s = 0.5e-3
    result = jax_tma.autotune(spec((512, 4096)), spec((4096, 1024)))
    assert result.xla_faster and result.xla_seconds == 0.5e-3
    assert _choice(512, 1024, 4096) is None  # measured: XLA's dot
    route = gemm.kernel_route(spec((512, 4096)), spec((4096, 1024)), MATMUL, BF16)
    why = gemm.why_xla(route, result.best, spec((512, 4096)), spec((4096, 1024)), BF16)
    assert "measured XLA's dot at 500.0 us against 1000.0 us" in why
    # JAX_TMA_KERNEL_ALWAYS=1 and an explicit config keep the kernel; the tuned tile is used.
    monkeypatch.setenv("JAX_TMA_KERNEL_ALWAYS", "1")
    assert _choice(512, 1024, 4096)[1] == result.best
    monkeypatch.delenv("JAX_TMA_KERNEL_ALWAYS")
    cfg = gemm_config.default_config(512, 1024, 4096)
    assert gemm.kernel_choice(spec((512, 4096)), spec((4096, 1024)), MATMUL, BF16,
                              config=cfg)[1] == cfg


def test_kernel_choice_reads_the_cache_once(fake_device, monkeypatch):
    """The configuration and XLA's time against it come from one read of the entry: a cache
    rewritten between two reads cannot pair one entry's tile with another's verdict."""
    monkeypatch.delenv("JAX_TMA_KERNEL_ALWAYS", raising=False)
    fake_device.xla_s = 0.5e-3
    result = jax_tma.autotune(spec((512, 4096)), spec((4096, 1024)))
    reads = []
    real = tuned.valid_entry
    monkeypatch.setattr(tuned, "valid_entry",
                        lambda *a: reads.append(a) or real(*a))
    assert _choice(512, 1024, 4096) is None  # measured: XLA's dot
    assert len(reads) == 1
    monkeypatch.setenv("JAX_TMA_KERNEL_ALWAYS", "1")
    assert _choice(512, 1024, 4096)[1] == result.best and len(reads) == 2
    # A named configuration reads no cache.
    cfg = gemm_config.default_config(512, 1024, 4096)
    assert gemm.kernel_choice(spec((512, 4096)), spec((4096, 1024)), MATMUL, BF16,
                              config=cfg)[1] == cfg and len(reads) == 2


def test_kernel_measured_faster_overrides_the_rule(fake_device, monkeypatch):
    monkeypatch.delenv("JAX_TMA_KERNEL_ALWAYS", raising=False)
    assert _choice(4096, 4096, 32) is None  # the rule: K shorter than one K block
    result = jax_tma.autotune(spec((4096, 32)), spec((32, 4096)))
    assert not result.xla_faster
    assert _choice(4096, 4096, 32)[1] == result.best


def test_entries_without_xla_time_leave_the_rule(fake_device, cache_file, monkeypatch):
    monkeypatch.delenv("JAX_TMA_KERNEL_ALWAYS", raising=False)
    result = jax_tma.autotune(spec((4096, 32)), spec((32, 4096)))
    data = json.loads(cache_file.read_text())
    del data["entries"][result.key]["xla_seconds"]  # an entry of an earlier release
    cache_file.write_text(json.dumps(data))
    plan = _plan(4096, 4096, 32)
    assert tuned.lookup(plan, BF16, BF16) == result.best
    assert tuned.measured_against_xla(plan, BF16, BF16) is None
    assert _choice(4096, 4096, 32) is None  # the rule again
    again = jax_tma.autotune(spec((4096, 32)), spec((32, 4096)))
    assert again.xla_seconds is None and not again.xla_faster


def test_max_candidates_times_the_cost_models_first(fake_device):
    result = jax_tma.autotune(spec((3000, 2048)), spec((2048, 5000)), max_candidates=3)
    plan = _plan(3000, 5000, 2048)
    assert fake_device[0] == gemm.ranked_for(plan, BF16)[:3]
    assert fake_device[0][0] == gemm.config_for(plan, BF16, None, use_cache=False)
    assert result.best in fake_device[0] and len(result.seconds) == 3
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(ValueError, match="max_candidates must be a positive int"):
            jax_tma.autotune(spec((3000, 2048)), spec((2048, 5000)), max_candidates=bad,
                             force=True)


def test_env_tunes_at_trace_time(fake_device, monkeypatch):
    monkeypatch.setenv("JAX_TMA_AUTOTUNE", "1")
    jax.jit(jax_tma.matmul).trace(spec((384, 2048)), spec((2048, 640)))
    assert len(fake_device) == 1
    assert tuned.lookup(_plan(384, 640, 2048), BF16, BF16) is not None
    jax.jit(lambda a, b: jax_tma.matmul(a, b) * 2).trace(spec((384, 2048)), spec((2048, 640)))
    assert len(fake_device) == 1  # the key is cached now
    monkeypatch.setenv("JAX_TMA_AUTOTUNE", "0")
    jax.jit(jax_tma.matmul).trace(spec((384, 4096)), spec((4096, 640)))
    assert len(fake_device) == 1
    # A product the rule leaves to XLA is tuned as well: the measurement decides.
    monkeypatch.setenv("JAX_TMA_AUTOTUNE", "1")
    jax.jit(jax_tma.matmul).trace(spec((2048, 32)), spec((32, 2048)))
    assert len(fake_device) == 2
    kernel_s, xla_s = tuned.measured_against_xla(_plan(2048, 2048, 32), BF16, BF16)
    assert kernel_s < xla_s == 5e-3


@needs_extension
def test_cuda_lowering_reads_the_cache():
    plan = _plan(8192, 4096, 1024)
    cfg = jax_tma.GemmConfig(block_m=128, block_n=128, stages=6, cluster_m=1, split_k=2)
    assert gemm.config_for(plan, BF16, None) != cfg  # not what the heuristic picks
    tuning_cache.store(tuned.cache_key(plan, BF16, BF16), {"config": dataclasses.asdict(cfg)})
    hlo = cuda_hlo(lambda a, b: jax_tma.matmul(a, b), spec((8192, 1024)), spec((1024, 4096)))
    for attr in ("block_m = 128", "block_n = 128", "stages = 6", "cluster_m = 1", "splits = 2"):
        assert attr in hlo, attr


@pytest.mark.gpu
def test_autotune_on_the_device(rng):
    m, n, k = 1000, 1536, 2048
    result = jax_tma.autotune(spec((m, k)), spec((k, n)), rounds=1, sets=1)
    assert result.best.describe() in result.seconds and len(result.seconds) > 5
    assert all(0 < s < 1 for s in result.seconds.values()) and 0 < result.xla_seconds < 1
    assert result.seconds[result.best.describe()] == min(result.seconds.values())
    assert tuned.lookup(_plan(m, n, k), BF16, BF16) == result.best
    kernel_s, xla_s = tuned.measured_against_xla(_plan(m, n, k), BF16, BF16)
    assert (kernel_s, xla_s) == (result.seconds[result.best.describe()], result.xla_seconds)
    with mock.patch.dict(os.environ, {"JAX_TMA_KERNEL_ALWAYS": "0"}):
        assert (_choice(m, n, k) is None) == result.xla_faster
    a = rng.standard_normal((m, k)).astype(BF16)
    b = rng.standard_normal((k, n)).astype(BF16)
    out = jax.jit(jax_tma.matmul)(a, b)
    assert rel_error(out, np.asarray(a, np.float64) @ np.asarray(b, np.float64)) <= 1e-2


@pytest.mark.gpu
def test_env_tunes_a_traced_product_on_the_device(rng, monkeypatch):
    monkeypatch.setenv("JAX_TMA_AUTOTUNE", "1")
    m, n, k = 640, 1024, 1536
    a = rng.standard_normal((m, k)).astype(BF16)
    b = rng.standard_normal((k, n)).astype(BF16)
    out = jax.jit(lambda a, b: jax_tma.matmul(a, b) + 1)(a, b)
    assert tuned.lookup(_plan(m, n, k), BF16, BF16) is not None
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64) + 1
    assert rel_error(out, ref) <= 1e-2


def test_bench_autotune_dry_run(tmp_path):
    """The benchmark's harness and report, on tiny shapes (without a GPU nothing is tuned)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_autotune.py"), "--dry-run", "--out",
         str(tmp_path), "--commit", "0123abc"], capture_output=True, text=True, timeout=600,
        env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    (device_dir,) = tmp_path.iterdir()
    report = json.loads((device_dir / "bench_autotune.json").read_text())
    assert [r["shape"] for r in report["rows"]] == [[64, 96, 128], [2, 32, 48, 64]]
    assert all(r["xla_s"] > 0 and r["jax_tma_default_s"] > 0 for r in report["rows"])
    table = (device_dir / "bench_autotune.md").read_text()
    assert table.startswith(report["environment"]["device"]) and "Geometric mean" in table
    assert report["environment"]["commit"] == "0123abc"
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_autotune.py"),
                          "--shapes", "1,2"], capture_output=True, text=True, timeout=600,
                         env=env, check=False)
    assert bad.returncode == 2 and "--shapes" in bad.stderr
