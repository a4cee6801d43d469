"""GPU tests of the TMA / mbarrier / cluster / pipeline primitives (csrc/ptx, csrc/pipeline).

Each test runs a purpose-built kernel from csrc/testing/ through jax_tma._testing and checks
every byte against numpy: the data that crossed, the exact shared-memory image TMA produced
(swizzle pattern and zero fill included), and the timeout flags of bounded waits, so a wrong
mask, transaction count or phase shows up as a failure rather than a hang.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_tma import _testing

pytestmark = pytest.mark.gpu

SENTINEL = 0xA5
SHORT_TIMEOUT = 20_000_000  # ~10 ms: for tests that expect a wait to time out


def swizzle_image(image: np.ndarray, swizzle: int) -> np.ndarray:
    """Where TMA puts each byte of a box image in shared memory (1024-byte aligned buffer):
    the 16-byte chunk index (address bits 4..) is XORed with address bits 7.."""
    if swizzle == 0:
        return image
    mask = swizzle // 16 - 1
    addr = np.arange(image.size)
    out = np.empty_like(image)
    out[addr ^ (((addr >> 7) & mask) << 4)] = image
    return out


def expected_images(x: np.ndarray, box: tuple[int, ...], swizzle: int) -> np.ndarray:
    """Shared-memory image of every box, boxes ordered innermost dimension fastest."""
    counts = [-(-d // b) for d, b in zip(x.shape, box)]
    images = []
    # Box index is decoded innermost-first, so iterate outermost dimension slowest.
    for corner in itertools.product(*[range(c) for c in counts]):
        region = np.zeros(box, x.dtype)  # out-of-bounds elements read as zero
        src = tuple(slice(c * b, min((c + 1) * b, d)) for c, b, d in zip(corner, box, x.shape))
        region[tuple(slice(0, s.stop - s.start) for s in src)] = x[src]
        images.append(swizzle_image(region.reshape(-1).view(np.uint8), swizzle))
    return np.stack(images)


def random_bits(rng, shape, dtype) -> np.ndarray:
    """Random payload of `dtype` (random bytes for 8-bit types, normal values otherwise)."""
    dtype = np.dtype(dtype)
    if dtype.itemsize == 1:
        return rng.integers(0, 256, shape, dtype=np.uint8).view(dtype)
    return rng.standard_normal(shape).astype(dtype)


BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
I8 = np.dtype(np.int8)
F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)

# (shape, box, dtype, swizzle): every rank 1..5, every swizzle mode, every element type, and
# extents that are not multiples of the box (zero fill on load, clipping on store).
ROUND_TRIP_CASES = [
    ((1000,), (64,), BF16, 128),
    ((300,), (32,), F32, 0),
    ((77, 200), (8, 64), BF16, 128),
    ((50, 104), (16, 32), F16, 64),
    ((33, 40), (4, 16), BF16, 32),
    ((64, 304), (32, 128), I8, 128),
    ((40, 160), (8, 64), FP8, 64),
    ((19, 68), (8, 32), F32, 128),
    ((20, 24), (8, 8), F32, 32),
    ((3, 17, 64), (2, 8, 64), BF16, 128),
    ((5, 9, 40), (2, 4, 16), F32, 64),
    ((2, 3, 9, 64), (1, 2, 8, 64), BF16, 128),
    ((3, 2, 5, 48), (2, 1, 4, 16), F16, 32),
    ((2, 2, 3, 5, 64), (1, 2, 2, 4, 64), BF16, 128),
    ((2, 3, 2, 7, 32), (2, 2, 1, 4, 32), I8, 0),
]


@pytest.mark.parametrize(
    "shape,box,dtype,swizzle", ROUND_TRIP_CASES,
    ids=[f"r{len(s)}-{d.name}-sw{w}" for s, _, d, w in ROUND_TRIP_CASES],
)
def test_tma_load_store_round_trip(rng, shape, box, dtype, swizzle):
    x = random_bits(rng, shape, dtype)
    y, images, timeouts = _testing.tma_round_trip(jnp.asarray(x), box, swizzle)
    assert int(timeouts[0]) == 0
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), x.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(images), expected_images(x, box, swizzle))


@pytest.mark.parametrize(
    "shape,box,dtype,swizzle,message",
    [
        ((64, 512), (8, 512), F32, 0, "box dimension 0 is 512"),
        ((64, 64), (8, 4), F16, 0, "inner box of 4 elements is 8 bytes"),
        ((64, 128), (8, 128), BF16, 128, "exceeds the 128-byte swizzle span"),
        ((64, 7), (8, 8), BF16, 0, "stride of dimension 1 is 14 bytes"),
        ((2, 2, 2, 2, 2, 8), (1, 1, 1, 1, 1, 8), BF16, 0, "rank 6 is outside 1..5"),
        ((64, 64), (8, 64), BF16, 96, "swizzle must be 0, 32, 64 or 128"),
    ],
    ids=["box-too-large", "inner-box-bytes", "swizzle-span", "row-stride", "rank-6", "swizzle-mode"],
)
def test_tensor_map_rejects_invalid_boxes(shape, box, dtype, swizzle, message):
    x = jnp.ones(shape, dtype)
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(_testing.tma_round_trip(x, box, swizzle))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_tma_reduce_add(rng, dtype):
    x = random_bits(rng, (300, 200), dtype)
    y0 = random_bits(rng, (300, 200), dtype)
    box = (64, 128 // dtype.itemsize)
    y, timeouts = _testing.tma_reduce_add(jnp.asarray(x), jnp.asarray(y0), box)
    assert int(timeouts[0]) == 0
    expected = (x.astype(np.float32) + y0.astype(np.float32)).astype(dtype)
    if dtype == F32:
        np.testing.assert_array_equal(np.asarray(y), expected)
    else:  # one bf16 rounding of the fp32 sum
        np.testing.assert_allclose(np.asarray(y, np.float32), expected.astype(np.float32),
                                   rtol=2**-7, atol=0)


def multicast_expectation(x: np.ndarray, cm: int, cn: int, issuers: int, mask_of) -> np.ndarray:
    size = cm * cn
    slices = x.reshape(size, -1).view(np.uint8).reshape(size, -1)
    box_bytes = slices.shape[1]
    out = np.full((size, size, box_bytes), SENTINEL, np.uint8)
    for issuer in range(size):
        if issuers >> issuer & 1:
            for cta in range(size):
                if mask_of(issuer) >> cta & 1:
                    out[cta, issuer] = slices[issuer]
    return out


def mask_same_n(cm: int, issuer: int) -> int:
    n = issuer // cm
    return sum(1 << (m + n * cm) for m in range(cm))


def mask_same_m(cm: int, cn: int, issuer: int) -> int:
    m = issuer % cm
    return sum(1 << (m + n * cm) for n in range(cn))


@pytest.mark.parametrize(
    "cm,cn,issuers,mask,mode",
    [
        (2, 1, 0b01, 0b11, 0),  # CTA 0 feeds both
        (2, 1, 0b11, 0b11, 0),  # both feed both
        (2, 1, 0b10, 0b01, 0),  # CTA 1 feeds only CTA 0 (not itself)
        (4, 1, 0b0001, 0b1111, 0),
        (4, 1, 0b0101, 0b0110, 0),  # CTAs 0 and 3 get nothing
        (4, 1, 0b1111, 0b1111, 0),
        (2, 2, 0b0101, 0, 1),  # m == 0 CTAs feed their n column
        (2, 2, 0b0011, 0, 2),  # n == 0 CTAs feed their m row
        (4, 1, 0b0001, 0, 1),
        (1, 4, 0b0001, 0, 2),
    ],
)
def test_tma_multicast(rng, cm, cn, issuers, mask, mode):
    size = cm * cn
    x = random_bits(rng, (size * 8, 64), F32)
    images, timeouts = _testing.tma_multicast(jnp.asarray(x), cm, cn, issuers, mask, mode)
    mask_of = {0: lambda i: mask, 1: lambda i: mask_same_n(cm, i), 2: lambda i: mask_same_m(cm, cn, i)}[mode]
    np.testing.assert_array_equal(np.asarray(timeouts), np.zeros(size, np.int32))
    np.testing.assert_array_equal(np.asarray(images), multicast_expectation(x, cm, cn, issuers, mask_of))


def test_wrong_transaction_count_times_out(rng):
    x = random_bits(rng, (2 * 8, 64), F32)
    images, timeouts = _testing.tma_multicast(
        jnp.asarray(x), 2, 1, 0b01, 0b11, 0, extra_tx_bytes=16, timeout_cycles=SHORT_TIMEOUT
    )
    np.testing.assert_array_equal(np.asarray(timeouts), np.ones(2, np.int32))
    # The bytes that were sent still landed.
    assert (np.asarray(images)[:, 0] == x[:8].view(np.uint8).reshape(-1)).all()


def pair_operands(rng, dtype, n):
    """n words of two `dtype` values each: half of them random bit patterns (NaNs, infinities
    and subnormals included), half values of random sign and magnitude over the type's whole
    exponent range, so that operands lie any number of binades apart."""
    bits = rng.integers(0, 2**16, (n // 2, 2), dtype=np.uint16)
    info = ml_dtypes.finfo(dtype)
    exponents = rng.integers(int(info.minexp) - int(info.nmant), int(info.maxexp), (n - n // 2, 2))
    values = (rng.uniform(1, 2, exponents.shape) * np.exp2(exponents.astype(np.float64))
              * rng.choice([-1, 1], exponents.shape)).astype(dtype)
    halves = np.concatenate([bits, values.view(np.uint16)])
    return np.ascontiguousarray(halves).view(np.uint32).reshape(-1)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_pair_math_matches_the_rounded_fp32_result(rng, dtype):
    """add_pairs and mul_pairs (the epilogue warps' packed bias, residual and gating
    arithmetic) give the bits of the fp32 sum or product rounded to the 16-bit type, which is
    what the unfused expression computes."""
    n = 1 << 20
    a, b = pair_operands(rng, dtype, n), pair_operands(rng, dtype, n)
    sums, products = _testing.pair_math(jnp.asarray(a), jnp.asarray(b), half=dtype == F16)
    x, y = a.view(dtype).astype(np.float32), b.view(dtype).astype(np.float32)
    for name, got, want in (("sum", sums, (x + y).astype(dtype)),
                            ("product", products, (x * y).astype(dtype))):
        got = np.asarray(got).view(dtype)
        nan = np.isnan(want.astype(np.float32))
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=name)
        mismatch = np.flatnonzero(got.view(np.uint16)[~nan] != want.view(np.uint16)[~nan])
        assert mismatch.size == 0, (
            f"{name}: {mismatch.size} of {got.size} differ, e.g. "
            f"{x.reshape(-1)[~nan][mismatch[0]]!r}, {y.reshape(-1)[~nan][mismatch[0]]!r}: "
            f"{got[~nan][mismatch[0]]!r} against {want[~nan][mismatch[0]]!r}")


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("consumers", [1, 3])
def test_pipeline_phases_over_many_iterations(stages, consumers):
    iterations = 1000  # hundreds of phase flips per stage
    seen, timeouts = _testing.pipeline_phases(stages, consumers, iterations)
    assert int(timeouts[0]) == 0
    expected = np.arange(iterations, dtype=np.int32) * 7 + 3
    np.testing.assert_array_equal(np.asarray(seen), np.broadcast_to(expected, (consumers, iterations)))


# ---------------------------------------------------- tensor maps edited on the device

# A template (rows, cols, row stride) over a flat f32 buffer, a box no larger than it, and
# groups (element offset, rows, cols, row stride). Every group but the first differs from the
# template in every field, and has rows or cols below the box, so a replace that did not take
# effect shows up as data where zeros belong (or the other way round) or as the wrong data.
TENSORMAP_TEMPLATE = (48, 40, 48)
TENSORMAP_BOX = (16, 32)
TENSORMAP_GROUPS = np.array(
    [
        (0, 48, 40, 48),  # the template itself
        (1000, 10, 20, 36),  # zero fill in both dimensions
        (5004, 100, 100, 104),  # larger than the template everywhere
        (20000, 16, 7, 12),  # a row narrower than 16 bytes
        (30000, 3, 64, 64),  # three rows, wider than the box
    ],
    np.int32,
)


def expected_group_image(flat: np.ndarray, group, box) -> np.ndarray:
    offset, rows, cols, stride = (int(v) for v in group)
    view = np.lib.stride_tricks.as_strided(
        flat[offset:], shape=(rows, cols), strides=(stride * flat.itemsize, flat.itemsize)
    )
    image = np.zeros(box, flat.dtype)  # out-of-bounds elements of the new dims read as zero
    r, c = min(rows, box[0]), min(cols, box[1])
    image[:r, :c] = view[:r, :c]
    return image.reshape(-1).view(np.uint8)


def test_tensormap_replace_in_global_memory(rng):
    flat = random_bits(rng, (40000,), F32)
    images, maps, timeouts = _testing.tensormap_replace(
        jnp.asarray(flat), TENSORMAP_GROUPS, TENSORMAP_TEMPLATE, TENSORMAP_BOX
    )
    assert int(timeouts[0]) == 0
    expected = np.stack([expected_group_image(flat, g, TENSORMAP_BOX) for g in TENSORMAP_GROUPS])
    np.testing.assert_array_equal(np.asarray(images), expected)
    # Group 0 wrote the template's own fields back; every other slot must differ from it.
    maps = np.asarray(maps)
    assert all((maps[g] != maps[0]).any() for g in range(1, len(maps)))


# ---------------------------------------------------------- distributed shared memory


@pytest.mark.parametrize("cluster_size", [2, 4])
@pytest.mark.parametrize("words", [1003, 4096])  # with and without single-word stores
def test_dsmem_store_completes_on_peer_barrier(rng, cluster_size, words):
    src = rng.integers(0, 2**32, (cluster_size, words), dtype=np.uint32)
    received, timeouts = _testing.dsmem_ring(jnp.asarray(src))
    assert int(timeouts[0]) == 0
    np.testing.assert_array_equal(np.asarray(received), np.roll(src, 1, axis=0))


def test_dsmem_wrong_byte_count_times_out(rng):
    src = rng.integers(0, 2**32, (2, 1003), dtype=np.uint32)
    received, timeouts = _testing.dsmem_ring(
        jnp.asarray(src), extra_tx_bytes=16, timeout_cycles=SHORT_TIMEOUT
    )
    assert int(timeouts[0]) == 2  # each CTA waited for 16 bytes that never came
    np.testing.assert_array_equal(np.asarray(received), np.roll(src, 1, axis=0))
