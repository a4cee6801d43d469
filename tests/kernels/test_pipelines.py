"""GPU tests of the pipelines and barriers in csrc/pipeline/ beyond PipelineAsync:
PipelineCpAsync, PipelineTmaAsync across a cluster (multicast-aware empty signalling and the
producer tail), PipelineTmaStore, NamedBarrier and OrderedBarrier.

Each runs a purpose-built kernel from csrc/testing/ for many ring passes and checks every value
against numpy; bounded waits turn a wrong arrival or byte count into a counted timeout.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_tma import _testing

pytestmark = pytest.mark.gpu

SHORT_TIMEOUT = 20_000_000  # ~10 ms: for tests that expect a wait to time out

# ---------------------------------------------------------------- PipelineCpAsync

CP_ASYNC_BYTES = 40 * 1024 + 333  # 41 chunks; the last one ends inside a 16-byte copy


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("consumers", [1, 3])
def test_cp_async_pipeline_copies_exactly(rng, stages, consumers):
    src = rng.integers(0, 256, CP_ASYNC_BYTES, dtype=np.uint8)
    out, timeouts = _testing.cp_async_pipeline(jnp.asarray(src), stages, consumers)
    assert int(timeouts[0]) == 0
    out = np.asarray(out)
    np.testing.assert_array_equal(out[:CP_ASYNC_BYTES], src)
    np.testing.assert_array_equal(out[CP_ASYNC_BYTES:], 0)  # zero fill of the last chunk


def test_cp_async_pipeline_wrong_producer_count_times_out(rng):
    src = rng.integers(0, 256, CP_ASYNC_BYTES, dtype=np.uint8)
    # 64 arrivals expected per phase, 32 producer threads arrive: no stage ever fills.
    _, timeouts = _testing.cp_async_pipeline(
        jnp.asarray(src), 2, 2, full_arrivals=64, timeout_cycles=SHORT_TIMEOUT
    )
    assert int(timeouts[0]) == 1 + 2  # the producer warp and both consumer warps


# ------------------------------------------------- PipelineTmaAsync across a cluster

ITERATIONS = 300
SLICE_ROWS = Y_ROWS = 8
COLS = 32  # float32: 1 KiB per slice and per private tile


def multicast_operands(rng, size: int):
    x = rng.standard_normal((ITERATIONS, size, SLICE_ROWS, COLS)).astype(np.float32)
    y = rng.standard_normal((size, ITERATIONS, Y_ROWS, COLS)).astype(np.float32)
    return x, y


def expected_stages(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """out[r, k]: the whole shared tile x[k], then CTA r's private tile y[r, k]."""
    size = y.shape[0]
    shared = np.broadcast_to(x.reshape(1, ITERATIONS, -1), (size, ITERATIONS, x[0].size))
    stages = np.concatenate([shared, y.reshape(size, ITERATIONS, -1)], axis=2)
    return stages.view(np.uint8)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("consumers", [1, 2])
def test_tma_pipeline_multicast_with_slow_cta(rng, size, stages, consumers):
    x, y = multicast_operands(rng, size)
    out, releases, tail_releases, timeouts = _testing.tma_multicast_pipeline(
        jnp.asarray(x), jnp.asarray(y), stages, consumers, slow_cta=size - 1
    )
    assert int(timeouts[0]) == 0
    # A producer that refilled a stage before every CTA's consumers released it overwrites
    # data the slow CTA has not read yet.
    np.testing.assert_array_equal(np.asarray(out), expected_stages(x, y))
    total = consumers * size * ITERATIONS
    np.testing.assert_array_equal(np.asarray(releases), np.full(size, total))
    # The producer tail returned only after the last release aimed at its CTA.
    np.testing.assert_array_equal(np.asarray(tail_releases), np.full(size, total))


def test_tma_pipeline_wrong_empty_count_times_out(rng):
    size, consumers = 2, 1
    x, y = multicast_operands(rng, size)
    *_, timeouts = _testing.tma_multicast_pipeline(
        jnp.asarray(x), jnp.asarray(y), 2, consumers, extra_empty_arrivals=1,
        timeout_cycles=SHORT_TIMEOUT,
    )
    # Every producer waits for an arrival that never comes, so every consumer starves.
    assert int(timeouts[0]) == size * (1 + consumers)


# ---------------------------------------------------------------- PipelineTmaStore


@pytest.mark.parametrize("stages", [2, 4])
def test_tma_store_pipeline(stages):
    iterations = 500
    rows, cols = _testing.STORE_TILE
    out = np.asarray(_testing.tma_store_pipeline(stages, iterations))
    tile = np.arange(iterations, dtype=np.int64)[:, None] * 65536 + np.arange(rows * cols)
    np.testing.assert_array_equal(out, tile.reshape(iterations * rows, cols))


# ---------------------------------------------------- NamedBarrier and OrderedBarrier


def test_named_barrier_ping_pong():
    iterations = 1000
    seen = np.asarray(_testing.named_barrier_ping_pong(iterations))
    k = np.arange(iterations)[:, None]
    slot = (np.arange(128)[None, :] + 37 + k) % 128
    np.testing.assert_array_equal(seen, k * 1000 + slot)


@pytest.mark.parametrize("groups", [2, 3])
def test_ordered_barrier_takes_turns(groups):
    passes = 200
    counters, log, timeouts = _testing.ordered_barrier(groups, passes)
    assert int(timeouts[0]) == 0
    np.testing.assert_array_equal(np.asarray(counters), [groups * passes] * 2)
    turns = np.tile(np.arange(groups), passes)
    np.testing.assert_array_equal(np.asarray(log), np.stack([turns, turns]))
