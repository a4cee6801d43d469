"""jax_tma.ragged_dot: lax.ragged_dot parity, the primitive's rules, the CUDA lowering, and the
grouped kernels on a Hopper GPU.

Error bounds (Frobenius-norm relative error against a float64 reference on random data): bf16
output 1e-2, fp16 2e-3, fp32 output from 16-bit operands 1e-5. GPU tests poison the output
(NaN) so that any row the kernel does not write fails.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jax_tma
from jax_tma.ops.ragged import config as rd_config
from jax_tma.ops.ragged import gated_grad_primitive as ggp
from jax_tma.ops.ragged import gated_primitive as gp
from jax_tma.ops.ragged import primitive as rd
from jax_tma.ops.ragged import sharding as ragged_sharding
from support import (REPO, cpu_mesh, cuda_hlo, f64_ragged_contraction, f64_ragged_rows,
                     group_sizes, needs_extension, random_array, rel_error, target_calls)

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
TOL = {BF16: 1e-2, F16: 2e-3, F32: 1e-5}
CONTRACTION_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])
ROWS_KN_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


# ---------------------------------------------------------------- lax parity (CPU)


PARITY = [  # (m, k, n, g)
    (40, 24, 16, 3),
    (7, 5, 3, 2),  # K, N not multiples of 8: padded on the kernel path
    (1, 8, 8, 1),
    (64, 32, 48, 8),
]


@pytest.mark.parametrize("dtype,out_dtype", [(BF16, None), (F16, None), (BF16, F32),
                                             (F32, None)])
@pytest.mark.parametrize("m,k,n,g", PARITY)
def test_matches_lax_and_float64(rng, m, k, n, g, dtype, out_dtype, request):
    if dtype == F32:
        request.getfixturevalue("exact_f32")
    x, w = random_array(rng, (m, k), dtype), random_array(rng, (g, k, n), dtype)
    gs = group_sizes("ragged" if g > 1 else "uniform", m, g, rng)
    ours = jax_tma.ragged_dot(x, w, gs, preferred_element_type=out_dtype)
    ref = lax.ragged_dot(x, w, gs, preferred_element_type=out_dtype)
    assert (ours.shape, ours.dtype) == (ref.shape, ref.dtype)
    out_tol = TOL[np.dtype(ours.dtype)] if ours.dtype != F32 else (1e-5 if dtype == F32 else 1e-2)
    assert rel_error(ours, f64_ragged_rows(x, w, gs)) <= max(out_tol, TOL.get(dtype, 1e-5))


@pytest.mark.parametrize("pattern", ["ragged", "short", "one"])
def test_contraction_and_k_major_forms_match_lax(rng, pattern):
    m, k, n, g = 48, 16, 24, 5
    gs = group_sizes(pattern, m, g, rng)
    x, dy = random_array(rng, (m, k), BF16), random_array(rng, (m, n), BF16)
    ours = jax_tma.ragged_dot_general(x, dy, gs, CONTRACTION_DIMS)
    ref = lax.ragged_dot_general(x, dy, gs, CONTRACTION_DIMS)
    assert (ours.shape, ours.dtype) == (ref.shape, ref.dtype) == ((g, k, n), BF16)
    assert rel_error(ours, f64_ragged_contraction(x, dy, gs)) <= TOL[BF16]
    w_nk = random_array(rng, (g, n, k), BF16)
    ours = jax_tma.ragged_dot_general(x, w_nk, gs, ROWS_KN_DIMS)
    assert rel_error(ours, f64_ragged_rows(x, w_nk, gs, w_k_major=True)) <= TOL[BF16]


ERROR_CASES = [
    ((8, 4), (2, 5, 3), (2,)),  # K mismatch
    ((8, 4), (3, 4, 3), (2,)),  # G mismatch
    ((8, 4), (2, 4, 3), ()),  # scalar group sizes
]


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16])
def test_narrow_integer_sizes(rng, dtype):
    """Sizes of a narrow integer type read as their values (the kernel's clamp to [0, M] works
    in int32: in int8, M = 200 would wrap), both forms."""
    m, k, n = 200, 64, 32
    x, dy = random_array(rng, (m, k), BF16), random_array(rng, (m, n), BF16)
    w = random_array(rng, (2, k, n), BF16)
    gs = np.array([100, 90], dtype)
    out = jax_tma.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
    assert rel_error(out, f64_ragged_rows(x, w, gs.astype(np.int32))) <= TOL[F32]
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dw = jax_tma.ragged_dot_general(x, dy, gs, dims, preferred_element_type=jnp.float32)
    assert rel_error(dw, f64_ragged_contraction(x, dy, gs.astype(np.int32))) <= TOL[F32]


@pytest.mark.parametrize("x_shape,w_shape,gs_shape", ERROR_CASES)
def test_errors_match_lax(x_shape, w_shape, gs_shape):
    x, w = jnp.ones(x_shape, jnp.bfloat16), jnp.ones(w_shape, jnp.bfloat16)
    gs = jnp.ones(gs_shape, jnp.int32)
    with pytest.raises(TypeError) as ref:
        lax.ragged_dot(x, w, gs)
    with pytest.raises(TypeError) as ours:
        jax_tma.ragged_dot(x, w, gs)
    assert str(ours.value) == str(ref.value)


def test_float_group_sizes_and_group_offset_match_lax():
    x, w = jnp.ones((8, 8), jnp.bfloat16), jnp.ones((2, 8, 8), jnp.bfloat16)
    with pytest.raises(TypeError, match="group_sizes"):
        jax_tma.ragged_dot(x, w, jnp.ones(2, jnp.float32))
    call = lambda fn: jax.block_until_ready(  # noqa: E731
        fn(x, w, jnp.array([4, 4]), group_offset=jnp.array([0])))
    with pytest.raises(Exception) as ref:  # lax refuses group_offset (the error varies by jax)
        call(lax.ragged_dot)
    with pytest.raises(type(ref.value)) as ours:
        call(jax_tma.ragged_dot)
    assert str(ours.value) == str(ref.value)


def test_rejects_configs_not_compiled_for_ragged():
    x, w, gs = jnp.ones((8, 8), jnp.bfloat16), jnp.ones((2, 8, 8), jnp.bfloat16), jnp.array([4, 4])
    with pytest.raises(ValueError, match="not compiled for ragged"):
        jax_tma.ragged_dot(x, w, gs, config=jax_tma.GemmConfig(64, 64, 12, 1))
    with pytest.raises(TypeError, match="GemmConfig"):
        jax_tma.ragged_dot(x, w, gs, config="fast")


def test_local_group_sizes_split_the_rows():
    gs = jnp.array([3, 0, 10, 2, 9], jnp.int32)  # 24 rows of 32 in groups; 8 rows past them
    rows, shards = 32, 4
    local = [np.asarray(ragged_sharding.local_group_sizes(gs, rows, jnp.int32(s), rows // shards))
             for s in range(shards)]
    np.testing.assert_array_equal(np.sum(local, axis=0), np.asarray(gs))
    np.testing.assert_array_equal(local[0], [3, 0, 5, 0, 0])
    np.testing.assert_array_equal(local[1], [0, 0, 5, 2, 1])
    np.testing.assert_array_equal(local[2], [0, 0, 0, 0, 8])
    np.testing.assert_array_equal(local[3], [0, 0, 0, 0, 0])


# ---------------------------------------------------------------- the primitive's rules (CPU)


def _prim(x, w, gs, mode=rd_config.ROWS, w_k_major=False, out_dtype=None):
    return rd.ragged_dot_p.bind(x, w, gs, mode=mode, w_k_major=w_k_major,
                                out_dtype=jnp.dtype(out_dtype or x.dtype), config=None,
                                local=False)


@pytest.mark.parametrize("mode,w_k_major", [(rd_config.ROWS, False), (rd_config.ROWS, True),
                                            (rd_config.CONTRACTION, False)])
def test_check_grads_order_2(rng, mode, w_k_major, on_cpu):
    """The rules, on the CPU device: float32 operands run through XLA's ragged products, which
    on an H100 missed the order-2 check by 1.8% even under default_matmul_precision("highest")
    (the kernel's gradients are checked on the GPU by the tests below)."""
    b, m, k, n, g = 2, 12, 4, 6, 3
    gs = np.stack([group_sizes("ragged", m, g, rng), group_sizes("short", m, g, rng)])
    x = random_array(rng, (b, m, k), F32)
    if mode == rd_config.ROWS:
        w = random_array(rng, (1, g, n, k) if w_k_major else (1, g, k, n), F32)
    else:
        w = random_array(rng, (b, m, n), F32)
    f = functools.partial(_prim, gs=jnp.asarray(gs), mode=mode, w_k_major=w_k_major)
    check_grads(f, (x, w), order=2, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2)


def test_grads_match_lax(rng):
    m, k, n, g = 40, 16, 24, 4
    x, w = random_array(rng, (m, k), F16), random_array(rng, (g, k, n), F16)
    gs = group_sizes("short", m, g, rng)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w, gs).astype(jnp.float32) ** 2)

    ours = jax.grad(loss(jax_tma.ragged_dot), (0, 1))(x, w)
    ref = jax.grad(loss(lax.ragged_dot), (0, 1))(x, w)
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel_error(a, b) <= 4 * TOL[F16]


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None), (0, None, 0), (None, 0, 0)])
def test_vmap_matches_lax(rng, in_axes):
    v, m, k, n, g = 3, 24, 8, 16, 4
    x = random_array(rng, (v, m, k) if in_axes[0] == 0 else (m, k), BF16)
    w = random_array(rng, (v, g, k, n) if in_axes[1] == 0 else (g, k, n), BF16)
    gs = (np.stack([group_sizes("ragged", m, g, rng) for _ in range(v)]) if in_axes[2] == 0
          else group_sizes("ragged", m, g, rng))
    ours = jax.vmap(jax_tma.ragged_dot, in_axes=in_axes)(x, w, gs)
    bcast = lambda a, ax: a if ax == 0 else np.broadcast_to(a, (v, *a.shape))  # noqa: E731
    ref = jax.vmap(lax.ragged_dot)(bcast(x, in_axes[0]), bcast(w, in_axes[1]),
                                   bcast(gs, in_axes[2]))
    assert ours.shape == ref.shape
    assert rel_error(ours, ref) <= TOL[BF16]


def test_nested_vmap_matches_lax(rng):
    m, k, n, g = 16, 8, 8, 2
    x = random_array(rng, (2, 3, m, k), BF16)
    w = random_array(rng, (g, k, n), BF16)
    gs = np.stack([[group_sizes("ragged", m, g, rng) for _ in range(3)] for _ in range(2)])
    ours = jax.vmap(jax.vmap(jax_tma.ragged_dot, in_axes=(0, None, 0)), in_axes=(0, None, 0))(
        x, w, gs)
    for i in range(2):
        for j in range(3):
            assert rel_error(ours[i, j], f64_ragged_rows(x[i, j], w, gs[i, j])) <= TOL[BF16]


# ---------------------------------------------------------------- sharding (8 CPU devices)


@pytest.mark.parametrize("x_spec,w_spec", [(P("x", None), P()), (P(), P(None, None, "x")),
                                           (P(None, "x"), P(None, "x", None)),
                                           (P("x", "y"), P(None, "y", None))])
def test_sharded_matches_unsharded(rng, x_spec, w_spec):
    mesh = cpu_mesh((4, 2), ("x", "y"))
    m, k, n, g = 64, 16, 32, 5
    x, w = random_array(rng, (m, k), F32).astype(BF16), random_array(rng, (g, k, n), BF16)
    gs = group_sizes("ragged", m, g, rng)
    xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, x_spec))
    ws = jax.device_put(jnp.asarray(w), NamedSharding(mesh, w_spec))
    out = jax.jit(jax_tma.ragged_dot)(xs, ws, jnp.asarray(gs))
    assert rel_error(out, f64_ragged_rows(x, w, gs)) <= TOL[BF16]
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(jax_tma.ragged_dot(x, w, gs).astype(
        jnp.float32) ** 2), (0, 1)))(xs, ws)
    ref = jax.grad(lambda x, w: jnp.sum(lax.ragged_dot(x, w, gs).astype(jnp.float32) ** 2),
                   (0, 1))(jnp.asarray(x), jnp.asarray(w))
    for a, b in zip(grads, ref):
        assert rel_error(a, b) <= 4 * TOL[BF16]


# ---------------------------------------------------------------- CUDA lowering (no GPU)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _kernel_calls(hlo: str) -> int:
    return target_calls(hlo, rd.KERNEL_TARGET)


@needs_extension
@pytest.mark.smoke
def test_cuda_lowering_calls_the_kernel():
    args = (_spec((4096, 1024), BF16), _spec((8, 1024, 512), BF16), _spec((8,), np.int32))
    assert _kernel_calls(cuda_hlo(jax_tma.ragged_dot, *args)) == 1
    # fp32 operands go to XLA
    args32 = (_spec((64, 32), F32), _spec((2, 32, 16), F32), _spec((2,), np.int32))
    assert _kernel_calls(cuda_hlo(jax_tma.ragged_dot, *args32)) == 0


@needs_extension
def test_cuda_lowering_backward_is_two_kernels_without_transposes():
    args = (_spec((4096, 1024), BF16), _spec((8, 1024, 512), BF16))
    gs = jnp.full(8, 512, jnp.int32)

    def loss(x, w):
        return jnp.sum(jax_tma.ragged_dot(x, w, gs))

    hlo = cuda_hlo(jax.grad(loss, (0, 1)), *args)
    assert _kernel_calls(hlo) == 2
    assert "stablehlo.transpose" not in hlo


@needs_extension
def test_cuda_lowering_vmap_is_one_kernel():
    args = (_spec((4, 512, 256), BF16), _spec((4, 8, 256, 128), BF16), _spec((4, 8), np.int32))
    assert _kernel_calls(cuda_hlo(jax.vmap(jax_tma.ragged_dot), *args)) == 1
    shared = (_spec((4, 512, 256), BF16), _spec((8, 256, 128), BF16), _spec((8,), np.int32))
    hlo = cuda_hlo(jax.vmap(jax_tma.ragged_dot, in_axes=(0, None, None)), *shared)
    assert _kernel_calls(hlo) == 1


def test_vmap_with_shared_weights_does_not_copy_them():
    x = _spec((4, 64, 32), BF16)
    w = _spec((8, 32, 16), BF16)
    gs = _spec((8,), np.int32)
    jaxpr = jax.make_jaxpr(jax.vmap(jax_tma.ragged_dot, in_axes=(0, None, None)))(x, w, gs)
    eqn = next(e for e in jaxpr.jaxpr.eqns if e.primitive is rd.ragged_dot_p)
    assert eqn.invars[1].aval.shape == (1, 8, 32, 16)


# ---------------------------------------------------------------- the kernel (Hopper GPU)


def _run_kernel(x, w, gs, mode, w_k_major, out_dtype, config):
    """The kernel's output over a NaN-poisoned buffer, through the primitive's plan."""
    x, w, gs = jnp.asarray(x), jnp.asarray(w), jnp.asarray(gs)
    if x.ndim == 2:
        x, w, gs = x[None], w[None], gs[None]
    plan = rd.kernel_plan(x, w, gs, mode, w_k_major, out_dtype)
    assert plan is not None
    fn = jax.jit(functools.partial(rd._kernel_call, plan=plan, w_k_major=w_k_major,
                                   out_dtype=out_dtype, config=config, poison=True))
    out = np.asarray(fn(x, w, gs))
    assert not np.isnan(out.astype(np.float32)).any(), "kernel left poisoned (unwritten) outputs"
    return out


CONFIG_IDS = ["x".join(map(str, c.tile)) for c in rd_config.RAGGED_CONFIGS]


@pytest.mark.gpu
@pytest.mark.parametrize("config", rd_config.RAGGED_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("pattern", ["ragged", "short", "one", "zipf"])
def test_kernel_rows_match_float64(rng, pattern, config):
    m, k, n, g = 1000, 256, 384, 7
    dtype = BF16 if pattern in ("ragged", "one") else F16
    x, w = random_array(rng, (m, k), dtype), random_array(rng, (g, k, n), dtype)
    gs = group_sizes(pattern, m, g, rng)
    out = _run_kernel(x, w, gs, rd_config.ROWS, False, dtype, config)[0]
    assert rel_error(out, f64_ragged_rows(x, w, gs)) <= TOL[dtype]
    assert np.all(out[int(gs.sum()):] == 0)


PAIRED_CONFIGS = [c for c in rd_config.RAGGED_CONFIGS if c.cluster_m == 2]


@pytest.mark.gpu
@pytest.mark.parametrize("config", PAIRED_CONFIGS, ids=[c.describe() for c in PAIRED_CONFIGS])
@pytest.mark.parametrize("case", ["even", "odd", "odd_end"])
def test_kernel_pairs_row_blocks_across_groups(rng, config, case):
    # A cluster of 2 takes two consecutive 128-row blocks of the groups' blocks numbered across
    # groups and batch entries: a group's last block and the next group's first share a cluster
    # (no multicast, each CTA with its own weights). The rows after an entry's last group (a
    # zero segment) start at an even block: "odd" leaves an idle block before them; "odd_end"
    # fills the second entry (no zero rows) with an odd number of blocks, the last one idle.
    first = [1, 129, 300, 0, 128, 257, 600, 40] if case == "even" else \
        [1, 100, 300, 0, 128, 257, 600, 40]  # 16 or 15 blocks, then 545 or 574 zero rows
    second = [600, 40, 0, 129, 1, 300, 257, 673] if case == "odd_end" else \
        [600, 40, 0, 129, 1, 300, 257, 128]  # 21 blocks and no zero rows, or 16 and 545
    gs = np.asarray([first, second], np.int32)
    b, m, k, n, g = 2, 2000, 256, 384, gs.shape[1]
    x = random_array(rng, (b, m, k), BF16)
    w = random_array(rng, (b, g, k, n), BF16)
    out = _run_kernel(x, w, gs, rd_config.ROWS, False, BF16, config)
    for i in range(b):
        assert rel_error(out[i], f64_ragged_rows(x[i], w[i], gs[i])) <= TOL[BF16]
        assert np.all(out[i][int(gs[i].sum()):] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("config", rd_config.RAGGED_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_kernel_rows_k_major_weights_and_fp32_out(rng, config, out_dtype):
    m, k, n, g = 777, 192, 320, 5
    x, w = random_array(rng, (m, k), BF16), random_array(rng, (g, n, k), BF16)
    gs = group_sizes("ragged", m, g, rng)
    out = _run_kernel(x, w, gs, rd_config.ROWS, True, out_dtype, config)[0]
    assert rel_error(out, f64_ragged_rows(x, w, gs, w_k_major=True)) <= TOL[out_dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("config", rd_config.RAGGED_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("pattern", ["ragged", "short", "zipf"])
def test_kernel_contraction_matches_float64(rng, pattern, config):
    m, k, n, g = 1500, 320, 256, 6
    dtype = F16 if pattern == "zipf" else BF16
    x, dy = random_array(rng, (m, k), dtype), random_array(rng, (m, n), dtype)
    gs = group_sizes(pattern, m, g, rng)
    out = _run_kernel(x, dy, gs, rd_config.CONTRACTION, False, F32, config)[0]
    ref = f64_ragged_contraction(x, dy, gs)
    assert rel_error(out, ref) <= TOL[F32] * 10
    for e in np.flatnonzero(gs == 0):
        assert np.all(out[e] == 0), f"empty group {e} not zero"


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,g", [(4096, 512, 256, 64), (3000, 136, 200, 3), (64, 64, 64, 1),
                                     (5, 8, 8, 4), (20000, 128, 128, 2)])
def test_kernel_edge_sizes_match_float64(rng, m, k, n, g):
    x, w = random_array(rng, (m, k), BF16), random_array(rng, (g, k, n), BF16)
    gs = group_sizes("ragged" if g > 1 else "uniform", m, g, rng)
    out = jax.jit(jax_tma.ragged_dot)(x, w, gs)
    assert rel_error(out, f64_ragged_rows(x, w, gs)) <= TOL[BF16]
    dy = random_array(rng, (m, n), BF16)
    dw = jax.jit(functools.partial(jax_tma.ragged_dot_general,
                                   ragged_dot_dimension_numbers=CONTRACTION_DIMS,
                                   preferred_element_type=jnp.float32))(x, dy, gs)
    assert rel_error(dw, f64_ragged_contraction(x, dy, gs)) <= 1e-4


@pytest.mark.gpu
def test_kernel_batched_matches_float64(rng):
    v, m, k, n, g = 3, 700, 128, 192, 6
    x, w = random_array(rng, (v, m, k), BF16), random_array(rng, (v, g, k, n), BF16)
    gs = np.stack([group_sizes(p, m, g, rng) for p in ("ragged", "short", "one")])
    out = np.asarray(jax.jit(jax.vmap(jax_tma.ragged_dot))(x, w, gs))
    shared = np.asarray(jax.jit(jax.vmap(jax_tma.ragged_dot, in_axes=(0, None, 0)))(x, w[0], gs))
    for i in range(v):
        assert rel_error(out[i], f64_ragged_rows(x[i], w[i], gs[i])) <= TOL[BF16]
        assert rel_error(shared[i], f64_ragged_rows(x[i], w[0], gs[i])) <= TOL[BF16]


@pytest.mark.gpu
def test_kernel_grads_match_float64(rng):
    m, k, n, g = 1024, 256, 128, 8
    x, w = random_array(rng, (m, k), BF16), random_array(rng, (g, k, n), BF16)
    gs = group_sizes("ragged", m, g, rng)
    dy = random_array(rng, (m, n), BF16)
    _, vjp = jax.vjp(lambda x, w: jax_tma.ragged_dot(x, w, gs), x, w)
    dx, dw = jax.jit(vjp)(jnp.asarray(dy))
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    ref_dx = f64_ragged_rows(dy64, np.swapaxes(w64, 1, 2), gs)
    assert rel_error(dx, ref_dx) <= TOL[BF16]
    assert rel_error(dw, f64_ragged_contraction(x64, dy64, gs)) <= TOL[BF16]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [c for c in rd_config.RAGGED_CONFIGS
                                    if c.tile in ((128, 256, 3, 2), (64, 256, 4, 1))],
                         ids=["128x256c2", "64x256"])
def test_kernel_is_deterministic(rng, config):
    m, k, n, g = 2000, 512, 512, 16
    x, w = random_array(rng, (m, k), BF16), random_array(rng, (g, k, n), BF16)
    gs = jnp.asarray(group_sizes("zipf", m, g, rng))
    f = jax.jit(functools.partial(jax_tma.ragged_dot, config=config))
    first = np.asarray(f(x, w, gs))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(x, w, gs)), first)


# ---------------------------------------------------------------- the Flax MoE example


@needs_extension
def test_moe_training_step_kernel_calls():
    """The CUDA lowering of examples/flax_moe.py's training step makes the calls the example
    expects: the gated first half's forward one gated_ragged_dot call, the down input gradient
    one gated gradient call (gated_ragged_mlp's backward), every other grouped product (the down
    forward, the three weight gradients) one ragged_dot call."""
    import sys
    sys.path.insert(0, str(REPO / "examples"))
    import flax_moe

    s = flax_moe.setup(tokens=256, d_model=64, d_ff=128, experts=4, top_k=2, use_tma=True)
    hlo = jax.jit(s.step).trace(s.params, s.opt_state, *s.batches[0]).lower(
        lowering_platforms=("cuda",)).as_text()
    gated = hlo.count(f"@{gp.KERNEL_TARGET}(")
    gated_grad = hlo.count(f"@{ggp.KERNEL_TARGET}(")
    assert gated == gated_grad == 1
    assert _kernel_calls(hlo) + gated + gated_grad == flax_moe.expected_kernel_calls()


def test_moe_example_matches_lax_on_cpu():
    import sys
    sys.path.insert(0, str(REPO / "examples"))
    import flax_moe

    kw = dict(tokens=256, d_model=32, d_ff=64, experts=4, top_k=2, dtype="bf16")
    ours = flax_moe.run(flax_moe.setup(use_tma=True, **kw), 20)
    ref = flax_moe.run(flax_moe.setup(use_tma=False, **kw), 20)
    assert ours[-1] < ours[0]
    assert flax_moe.max_relative_difference(ours, ref) <= flax_moe.TOLERANCE["bf16"]


# ---------------------------------------------------------------- jax.export


@needs_extension
def test_export_round_trip(rng):
    """Exported for cpu and cuda with jax_tma.export_disabled_checks() (serialized and read
    back): the CUDA branch holds the kernel, the CPU branch computes lax.ragged_dot's values."""
    m, k, n, g = 48, 16, 24, 3
    x, w = random_array(rng, (m, k), BF16), random_array(rng, (g, k, n), BF16)
    gs = group_sizes("ragged", m, g, rng)
    exported = jax.export.export(jax.jit(jax_tma.ragged_dot), platforms=("cpu", "cuda"),
                                 disabled_checks=jax_tma.export_disabled_checks())(
        _spec((m, k), BF16), _spec((g, k, n), BF16), _spec((g,), np.int32))
    exported = jax.export.deserialize(exported.serialize())
    assert exported.mlir_module().count(f"@{rd.KERNEL_TARGET}(") == 1
    out = exported.call(jax.device_put(x, jax.devices("cpu")[0]), w, gs)
    assert rel_error(out, f64_ragged_rows(x, w, gs)) <= TOL[BF16]
