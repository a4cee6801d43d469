"""GPU tests of the persistent TMA copy kernel behind benchmarks/bench_tma_copy.py: exact for
shapes that are not multiples of its 16-row x 1 KiB tile, for every compiled stage count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_tma import _testing

pytestmark = pytest.mark.gpu

SHAPES = [
    ((1000, 1000), np.float32),
    ((777, 1240), ml_dtypes.bfloat16),
    ((5, 4096), np.float32),  # fewer rows than one tile
    ((3, 7, 96), np.int8),  # rows of 96 bytes, leading dimensions folded into rows
    ((100003,), np.float32),  # one row, 400012 bytes
]


@pytest.mark.parametrize("shape,dtype", SHAPES, ids=[f"{s}-{np.dtype(d).name}" for s, d in SHAPES])
@pytest.mark.parametrize("stages,ctas_per_sm", [(12, 1), (6, 2), (4, 3)])
def test_tma_copy_is_exact(rng, shape, dtype, stages, ctas_per_sm):
    x = rng.integers(0, 256, np.prod(shape) * np.dtype(dtype).itemsize, dtype=np.uint8)
    x = x.view(dtype).reshape(shape)
    y = _testing.tma_copy(jnp.asarray(x), stages, ctas_per_sm)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), x.view(np.uint8))


def test_d2d_copy_is_exact(rng):
    x = rng.standard_normal((333, 444)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(_testing.d2d_copy(jnp.asarray(x))), x)


def test_tma_copy_rejects_unaligned_rows():
    with pytest.raises(Exception, match="not a multiple of 16"):
        jax.block_until_ready(_testing.tma_copy(jnp.ones((8, 7), jnp.bfloat16)))
