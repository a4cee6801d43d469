"""jax_tma.dot_general: lax.dot_general parity, the primitive's rules (jvp, transpose, vmap),
the kernel view of operands (gemm_plan), the CUDA lowering (one kernel per product, transposed
operands read in place) and the kernel on a Hopper GPU.

Error bounds (Frobenius-norm relative error against float64 on random data): bf16 1e-2,
fp16 2e-3, fp32 output of 16-bit operands 1e-5. Parity with lax on the CPU is measured
against |lhs| . |rhs| (short dots cancel). The rules are checked numerically with
``check_grads`` on fp32 operands bound straight to the primitive (its XLA lowering), since
finite differences mean nothing in bf16.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import jax_tma
from jax_tma import _testing
from jax_tma.ops.gemm import config as gemm_config
from jax_tma.ops.gemm import plan as gemm_plan
from jax_tma.ops.gemm import primitive as gemm
from support import cuda_hlo, needs_extension, random_array, rel_error

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
TOL = {BF16: 1e-2, F16: 2e-3, F32: 1e-5}
F32_OPERAND_TOL = 2e-3  # fp32 operands go to XLA, which runs them as TF32 on GPUs

MATMUL = (((1,), (0,)), ((), ()))
# (lhs shape, rhs shape, dimension numbers, layout the kernel reads them in)
CASES = [
    ((64, 32), (32, 48), MATMUL, "NN"),
    ((64, 32), (48, 32), (((1,), (1,)), ((), ())), "NT"),  # x @ w.T (Dense dgrad)
    ((32, 64), (32, 48), (((0,), (0,)), ((), ())), "TN"),  # x.T @ g (Dense wgrad)
    ((32, 64), (48, 32), (((0,), (1,)), ((), ())), "TT"),
    ((4, 64, 32), (4, 32, 48), (((2,), (1,)), ((0,), (0,))), "NN"),  # batched
    ((4, 32, 64), (4, 48, 32), (((1,), (2,)), ((0,), (0,))), "TT"),
    ((2, 3, 16, 32), (2, 3, 32, 24), (((3,), (2,)), ((0, 1), (0, 1))), "NN"),  # two batch dims
    ((16, 4, 32), (4, 32, 24), (((2,), (1,)), ((1,), (0,))), "NN"),  # batch in the middle
    ((5, 16, 32), (32, 24), (((2,), (0,)), ((), ())), "NN"),  # lhs free dims fold into M
    ((16, 32), (3, 32, 24), (((1,), (1,)), ((), ())), "NN"),  # rhs free dims: batch axis
    ((8, 4, 32), (32, 8, 4), (((2,), (0,)), ((), ())), "NN"),  # multi-axis free dims
    ((16, 4, 8), (4, 8, 24), (((1, 2), (0, 1)), ((), ())), "NN"),  # two contracting dims
    ((32,), (32, 24), (((0,), (0,)), ((), ())), "NN"),  # vector-matrix
    ((16, 32), (32,), (((1,), (0,)), ((), ())), "NT"),  # matrix-vector
    ((16, 30), (30, 24), MATMUL, "NN"),  # a's rows padded
    ((16, 32), (32, 7), MATMUL, "NN"),  # b's rows padded
]
CASE_IDS = [f"{a}x{b}-{dims}" for a, b, dims, _ in CASES]


def _operands(rng, lhs_shape, rhs_shape, dtype):
    return random_array(rng, lhs_shape, dtype), random_array(rng, rhs_shape, dtype)


def _f64_dot(lhs, rhs, dims) -> np.ndarray:
    """dot_general in float64 numpy (einsum), output dims ordered as lax orders them."""
    (lc, rc), (lb, rb) = dims
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    ls = [next(letters) for _ in range(lhs.ndim)]
    rs = [next(letters) for _ in range(rhs.ndim)]
    for i, j in (*zip(lc, rc), *zip(lb, rb)):
        rs[j] = ls[i]
    out = [ls[i] for i in lb]
    out += [ls[i] for i in range(lhs.ndim) if i not in lc and i not in lb]
    out += [rs[j] for j in range(rhs.ndim) if j not in rc and j not in rb]
    return np.einsum(f"{''.join(ls)},{''.join(rs)}->{''.join(out)}", lhs, rhs)


def _bound_error(out, lhs, rhs, dims) -> float:
    """Error of `out` relative to |lhs| . |rhs| (a scale that cancellation cannot shrink)."""
    exact = _f64_dot(lhs, rhs, dims)
    scale = _f64_dot(np.abs(np.asarray(lhs, np.float64)), np.abs(np.asarray(rhs, np.float64)), dims)
    return float(np.max(np.abs(np.asarray(out, np.float64) - exact) / np.maximum(scale, 1e-30)))


def prim_dot(lhs, rhs, dims):
    """The primitive itself, for any dtype (the public op sends fp32 straight to lax)."""
    return gemm.dot_general_p.bind(lhs, rhs, dimension_numbers=dims,
                                   out_dtype=jnp.result_type(lhs), precision=None, config=None,
                                   local=False)


def spec(shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


# ---------------------------------------------------------------- lax parity (CPU)


@pytest.mark.parametrize("dtype,preferred", [(BF16, None), (F16, None), (BF16, np.float32), (F32, None)])
@pytest.mark.parametrize("lhs_shape,rhs_shape,dims,layout", CASES, ids=CASE_IDS)
def test_matches_lax(rng, lhs_shape, rhs_shape, dims, layout, dtype, preferred):
    del layout
    lhs, rhs = _operands(rng, lhs_shape, rhs_shape, dtype)
    out = jax_tma.dot_general(lhs, rhs, dims, preferred_element_type=preferred)
    ref = lax.dot_general(lhs, rhs, dims, preferred_element_type=preferred)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if dtype == F32:
        np.testing.assert_array_equal(out, ref)  # not a kernel dtype: lax itself
        bound = F32_OPERAND_TOL
    else:
        bound = 2 * TOL[np.dtype(out.dtype) if preferred is None else F32] + TOL[dtype]
    assert _bound_error(out, lhs, rhs, dims) <= bound


@pytest.mark.parametrize(
    "lhs_shape,rhs_shape,dims",
    [
        ((4, 8), (9, 4), MATMUL),  # contracting sizes differ
        ((4, 8), (8, 4), (((2,), (0,)), ((), ()))),  # axis out of range
        ((2, 4, 8), (3, 8, 4), (((2,), (1,)), ((0,), (0,)))),  # batch sizes differ
        ((4, 8), (8, 4), (((1,), (0,)), ((0,), ()))),  # unpaired batch dims
    ],
)
def test_errors_match_lax(lhs_shape, rhs_shape, dims):
    lhs, rhs = jnp.ones(lhs_shape, BF16), jnp.ones(rhs_shape, BF16)
    with pytest.raises(Exception) as expected:
        lax.dot_general(lhs, rhs, dims)
    with pytest.raises(type(expected.value)) as ours:
        jax_tma.dot_general(lhs, rhs, dims)
    assert str(ours.value) == str(expected.value)


def test_flax_style_call_with_precision():
    """Flax layers pass precision (and preferred_element_type) by keyword."""
    x, w = jnp.ones((4, 8), BF16), jnp.ones((8, 2), BF16)
    out = jax_tma.dot_general(x, w, MATMUL, precision=lax.Precision.HIGHEST, preferred_element_type=None)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.full((4, 2), 8.0))


def test_rejects_non_config():
    with pytest.raises(TypeError, match="GemmConfig"):
        jax_tma.dot_general(jnp.ones((4, 8), BF16), jnp.ones((8, 2), BF16), MATMUL, config=(128, 256))


# ---------------------------------------------------------------- kernel view (gemm_plan)


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims,layout", CASES, ids=CASE_IDS)
def test_plan_reads_every_case_in_place(lhs_shape, rhs_shape, dims, layout):
    plan = gemm_plan.plan(lhs_shape, rhs_shape, dims)
    assert plan is not None and plan.layout == layout
    out_shape = gemm_plan.output_shape(lhs_shape, rhs_shape, dims)
    assert plan.batch * plan.m * plan.n == np.prod(out_shape)


def _strided_reference(lhs, rhs, plan: gemm_plan.GemmPlan, out_size: int) -> np.ndarray:
    """Evaluates the plan's strided view in numpy, element by element of the view."""
    def flat(x, view):
        x = np.asarray(x, np.float64)
        if view.pad:
            widths = [(0, 0)] * x.ndim
            widths[view.pad_axis] = (0, view.pad)
            x = np.pad(x, widths)
        return x.reshape(-1)

    a, b = flat(lhs, plan.lhs), flat(rhs, plan.rhs)
    d = np.full(out_size, np.nan)
    bi, mi, ni, ki = np.ix_(np.arange(plan.batch), np.arange(plan.m), np.arange(plan.n), np.arange(plan.k))
    av = a[bi * plan.lhs.batch_stride + mi * plan.lhs.outer_stride + ki * plan.lhs.k_stride]
    bv = b[bi * plan.rhs.batch_stride + ki * plan.rhs.k_stride + ni * plan.rhs.outer_stride]
    prod = (av * bv).sum(axis=-1)
    idx = bi[..., 0] * plan.d_batch_stride + mi[..., 0] * plan.d_m_stride + ni[..., 0]
    d[idx.reshape(-1)] = prod.reshape(-1)
    return d


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims,layout", CASES, ids=CASE_IDS)
def test_plan_strides_compute_dot_general(rng, lhs_shape, rhs_shape, dims, layout):
    """The strides the kernel is given, walked in numpy, give lax.dot_general's output."""
    del layout
    lhs, rhs = _operands(rng, lhs_shape, rhs_shape, F32)
    plan = gemm_plan.plan(lhs_shape, rhs_shape, dims)
    expected = _f64_dot(lhs, rhs, dims)
    got = _strided_reference(lhs, rhs, plan, expected.size)
    np.testing.assert_allclose(got, expected.reshape(-1), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize(
    "lhs_shape,rhs_shape,dims",
    [
        ((32, 16, 4), (32, 24, 4), (((0,), (0,)), ((2,), (2,)))),  # batch is the innermost axis
        ((8, 4, 3), (4, 3, 16), (((1, 2), (0, 1)), ((), ()))),  # 12-element rows, K of 2 axes
        ((0, 8), (8, 4), MATMUL),  # empty
    ],
)
def test_plan_declines_what_it_cannot_read(lhs_shape, rhs_shape, dims):
    assert gemm_plan.plan(lhs_shape, rhs_shape, dims) is None


@pytest.mark.parametrize(
    "lhs_shape,rhs_shape,dims,expected",
    [
        ((1024, 1024), (1024, 1024), MATMUL, ""),
        ((1008, 1008), (1008, 1008), MATMUL, ""),  # 2016-byte rows: 32-byte multiples
        ((1000, 1000), (1000, 1000), MATMUL, "ab"),  # 2000-byte rows
        ((3000, 2048), (2048, 5000), MATMUL, "b"),  # only B's rows
        ((1024, 1000), (1000, 1024), MATMUL, "a"),  # only A's rows
        ((1, 1000), (1000, 1024), MATMUL, ""),  # a single row of A has no pitch
        ((64, 1000), (64, 1024), (((0,), (0,)), ((), ())), "a"),  # A stored [K, M]
        ((2500, 2500), (2500, 2500), MATMUL, ""),  # padded rows: to 2512 elements, not 2504
        ((3000, 4097), (4097, 4097), MATMUL, ""),
    ],
)
def test_plan_flags_rows_that_slow_tma(lhs_shape, rhs_shape, dims, expected):
    assert gemm_plan.plan(lhs_shape, rhs_shape, dims).misaligned_rows == expected


# ---------------------------------------------------------------- rules (CPU)

RULE_CASES = [c for c in CASES if c[3] in ("NN", "NT", "TN", "TT")][:8]


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims,layout", RULE_CASES, ids=CASE_IDS[:8])
def test_check_grads_order_2(rng, lhs_shape, rhs_shape, dims, layout, exact_f32):
    del layout
    small = lambda s: tuple(min(d, 6) for d in s)  # noqa: E731 - finite differences are costly
    lhs_shape, rhs_shape = small(lhs_shape), small(rhs_shape)
    lhs, rhs = _operands(rng, lhs_shape, rhs_shape, F32)
    check_grads(functools.partial(prim_dot, dims=dims), (lhs, rhs), order=2, modes=("fwd", "rev"),
                atol=5e-2, rtol=5e-2)


def test_hessian_matches_lax(rng):
    w = random_array(rng, (6, 4), F32)
    x = random_array(rng, (3, 6), F32)
    ours = jax.hessian(lambda x: jnp.sum(jnp.tanh(prim_dot(x, w, MATMUL))))(x)
    ref = jax.hessian(lambda x: jnp.sum(jnp.tanh(lax.dot_general(x, w, MATMUL))))(x)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lhs_shape,rhs_shape,dims,layout", CASES, ids=CASE_IDS)
def test_grad_matches_lax(rng, lhs_shape, rhs_shape, dims, layout):
    del layout
    lhs, rhs = _operands(rng, lhs_shape, rhs_shape, F32)
    loss = lambda dot: lambda x, y: jnp.sum(jnp.sin(dot(x, y, dims)))  # noqa: E731
    ours = jax.grad(loss(prim_dot), (0, 1))(lhs, rhs)
    ref = jax.grad(loss(lax.dot_general), (0, 1))(lhs, rhs)
    for o, r in zip(ours, ref):
        assert o.shape == r.shape
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4)


VMAP_AXES = [(0, None), (None, 0), (0, 0), (1, None), (None, 1), (1, 2), (2, 0)]


def _mapped_shape(shape, axis, size=3):
    return tuple(shape) if axis is None else tuple(int(d) for d in np.insert(shape, axis, size))


@pytest.mark.parametrize("in_axes", VMAP_AXES, ids=[str(a) for a in VMAP_AXES])
def test_vmap_matches_lax(rng, in_axes):
    lhs = random_array(rng, _mapped_shape((16, 8), in_axes[0]), F32)
    rhs = random_array(rng, _mapped_shape((8, 12), in_axes[1]), F32)
    ours = jax.vmap(functools.partial(prim_dot, dims=MATMUL), in_axes)(lhs, rhs)
    ref = jax.vmap(functools.partial(lax.dot_general, dimension_numbers=MATMUL), in_axes)(lhs, rhs)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_nested_vmap_and_grad_compositions(rng):
    x, w = random_array(rng, (2, 3, 16, 8), F32), random_array(rng, (2, 3, 8, 12), F32)
    f = lambda dot: lambda x, w: jnp.sum(jnp.sin(dot(x, w, MATMUL)))  # noqa: E731
    vv = lambda dot: jax.vmap(jax.vmap(lambda x, w: dot(x, w, MATMUL)))  # noqa: E731
    np.testing.assert_allclose(vv(prim_dot)(x, w), vv(lax.dot_general)(x, w), rtol=1e-5, atol=1e-5)
    for wrap in (lambda g: jax.vmap(jax.grad(g, (0, 1))), lambda g: jax.grad(lambda x, w: jnp.sum(jax.vmap(g)(x, w)), (0, 1))):
        ours = wrap(f(prim_dot))(x[0], w[0])
        ref = wrap(f(lax.dot_general))(x[0], w[0])
        for o, r in zip(ours, ref):
            np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4)


def test_public_bf16_gradients_match_lax(rng):
    x, w = random_array(rng, (32, 64), BF16), random_array(rng, (64, 16), BF16)
    loss = lambda dot: lambda x, w: jnp.sum(dot(x, w, MATMUL).astype(jnp.float32) ** 2)  # noqa: E731
    ours = jax.grad(loss(jax_tma.dot_general), (0, 1))(x, w)
    ref = jax.grad(loss(lax.dot_general), (0, 1))(x, w)
    for o, r in zip(ours, ref):
        assert o.dtype == r.dtype == BF16
        assert rel_error(o, r) <= 2 * TOL[BF16]


# ---------------------------------------------------------------- CUDA lowering (CPU)

KERNEL_CALL = f"custom_call @{gemm.KERNEL_TARGET}("


def _assert_kernels(hlo: str, count: int, output_transpose: bool = False) -> None:
    """`count` kernel calls, no XLA dot, and no transpose before the kernels (an operand is
    never transposed; with `output_transpose`, vmap may move the mapped axis of the result)."""
    assert hlo.count(KERNEL_CALL) == count, hlo
    assert "stablehlo.dot_general" not in hlo
    before, _, after = hlo.rpartition(KERNEL_CALL)
    assert "stablehlo.transpose" not in before
    assert ("stablehlo.transpose" in after) == output_transpose


@needs_extension
@pytest.mark.parametrize("lhs_shape,rhs_shape,dims,layout", CASES, ids=CASE_IDS)
def test_cuda_lowering_reads_operands_in_place(lhs_shape, rhs_shape, dims, layout):
    hlo = cuda_hlo(lambda x, y: jax_tma.dot_general(x, y, dims), spec(lhs_shape), spec(rhs_shape))
    _assert_kernels(hlo, 1)
    a_k, b_k = ("a_k_stride = 1 :", "b_k_stride = 1 :")
    assert (a_k in hlo) == (layout[0] == "N") and (b_k in hlo) == (layout[1] == "T")


@needs_extension
def test_cuda_lowering_nested_vmap_is_one_kernel():
    f = jax.vmap(jax.vmap(jax_tma.matmul))
    _assert_kernels(cuda_hlo(f, spec((2, 3, 64, 32)), spec((2, 3, 32, 48))), 1)
    assert "batch = 6 :" in cuda_hlo(f, spec((2, 3, 64, 32)), spec((2, 3, 32, 48)))


# (in_axes, whether vmap's out_axes=0 moves the mapped axis of the result): only rhs mapped
# puts it after lhs's free dims. A mapped axis that is an operand's innermost (unit-stride)
# axis cannot be read in place: that operand is transposed first (test below).
VMAP_KERNEL_AXES = [((0, None), False), ((None, 0), True), ((0, 0), False), ((1, None), True),
                    ((None, 1), True), ((1, 0), False)]


@needs_extension
@pytest.mark.parametrize("in_axes,moves_result", VMAP_KERNEL_AXES, ids=[str(a) for a, _ in VMAP_KERNEL_AXES])
def test_cuda_lowering_vmap_is_one_kernel(in_axes, moves_result):
    lhs, rhs = spec(_mapped_shape((64, 32), in_axes[0])), spec(_mapped_shape((32, 48), in_axes[1]))
    _assert_kernels(cuda_hlo(jax.vmap(jax_tma.matmul, in_axes), lhs, rhs), 1, moves_result)


@needs_extension
@pytest.mark.parametrize("in_axes", [(2, None), (None, 2), (2, 2)], ids=str)
def test_cuda_lowering_vmap_of_an_innermost_axis_is_one_kernel(in_axes):
    """A mapped axis that is an operand's innermost axis: one kernel, after at most one copy
    (padded rows, or a transpose) of each such operand (none for rhs, whose mapped axis joins
    its free dims: N = 48 x 3)."""
    lhs, rhs = spec(_mapped_shape((64, 32), in_axes[0])), spec(_mapped_shape((32, 48), in_axes[1]))
    hlo = cuda_hlo(jax.vmap(jax_tma.matmul, in_axes), lhs, rhs)
    assert hlo.count(KERNEL_CALL) == 1 and "stablehlo.dot_general" not in hlo
    before = hlo.rpartition(KERNEL_CALL)[0]
    copies = before.count("stablehlo.transpose") + before.count("call @_pad")
    assert copies <= sum(a is not None for a in in_axes)


def _dense_loss(x, w):
    return jnp.sum(jax_tma.dot_general(x, w, MATMUL).astype(jnp.float32) ** 2)


@needs_extension
@pytest.mark.smoke
def test_cuda_lowering_dense_backward_is_two_kernels():
    x, w = spec((256, 64)), spec((64, 128))
    _, pullback = jax.vjp(lambda x, w: jax_tma.dot_general(x, w, MATMUL), jnp.zeros(x.shape, BF16), jnp.zeros(w.shape, BF16))
    _assert_kernels(cuda_hlo(pullback, spec((256, 128))), 2)
    # Forward plus backward in one step: three kernels, no transposes.
    _assert_kernels(cuda_hlo(jax.value_and_grad(_dense_loss, (0, 1)), x, w), 3)


@needs_extension
def test_cuda_lowering_flax_style_dense_general():
    """DenseGeneral contracts the trailing axes of [batch, seq, heads, head_dim] inputs."""
    dims = (((2, 3), (0, 1)), ((), ()))
    f = lambda x, w: jax_tma.dot_general(x, w, dims)  # noqa: E731
    _assert_kernels(cuda_hlo(f, spec((2, 16, 4, 32)), spec((4, 32, 64))), 1)
    g = jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32)), (0, 1))
    _assert_kernels(cuda_hlo(g, spec((2, 16, 4, 32)), spec((4, 32, 64))), 2)


# ---------------------------------------------------------------- the kernel (Hopper GPU)

LAYOUT_DIMS = {
    "NN": ((lambda m, k: (m, k)), (lambda k, n: (k, n)), (((1,), (0,)), ((), ()))),
    "NT": ((lambda m, k: (m, k)), (lambda k, n: (n, k)), (((1,), (1,)), ((), ()))),
    "TN": ((lambda m, k: (k, m)), (lambda k, n: (k, n)), (((0,), (0,)), ((), ()))),
    "TT": ((lambda m, k: (k, m)), (lambda k, n: (n, k)), (((0,), (1,)), ((), ()))),
}
LAYOUT_SHAPES = [(256, 384, 512), (129, 1000, 72), (7, 4097, 200), (1000, 7, 136), (1, 256, 4104)]
LAYOUT_CONFIGS = [None, *gemm_config.COMPILED_CONFIGS, jax_tma.GemmConfig(128, 128, 6, 2, split_k=3)]
LAYOUT_CONFIG_IDS = ["default"] + [f"m{c.block_m}n{c.block_n}c{c.cluster_m}k{c.split_k}" for c in LAYOUT_CONFIGS[1:]]


def _poisoned_or_raises(lhs, rhs, dims, out_dtype, config):
    """The kernel's output over NaN-filled buffers, or None when `config` (a TMA-store tile)
    cannot store this output, which must then raise."""
    plan = gemm.kernel_plan(lhs, rhs, dims, out_dtype)
    assert plan is not None
    try:
        gemm.config_for(plan, out_dtype, config)
    except ValueError:
        with pytest.raises(ValueError, match="16 bytes"):
            _testing.gemm_poisoned(lhs, rhs, out_dtype, config=config, dimension_numbers=dims)
        return None
    out = np.asarray(_testing.gemm_poisoned(lhs, rhs, out_dtype, config=config, dimension_numbers=dims))
    assert not np.isnan(out).any(), "kernel left poisoned (unwritten) outputs"
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("config", LAYOUT_CONFIGS, ids=LAYOUT_CONFIG_IDS)
@pytest.mark.parametrize("m,n,k", LAYOUT_SHAPES)
@pytest.mark.parametrize("layout", sorted(LAYOUT_DIMS))
def test_kernel_layouts_match_float64(rng, layout, m, n, k, config):
    lhs_of, rhs_of, dims = LAYOUT_DIMS[layout]
    dtype = BF16 if (m + n) % 2 else F16
    lhs, rhs = _operands(rng, lhs_of(m, k), rhs_of(k, n), dtype)
    out = _poisoned_or_raises(lhs, rhs, dims, dtype, config)
    if out is not None:
        assert rel_error(out, _f64_dot(lhs, rhs, dims)) <= TOL[dtype]


BATCHED_CASES = [c for c in CASES if len(c[0]) > 2 or len(c[1]) > 2]


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [None, F32])
@pytest.mark.parametrize("config", [None, jax_tma.GemmConfig(128, 128, 6, 2), jax_tma.GemmConfig(64, 128, 8, 1, split_k=2)],
                         ids=["default", "cluster2", "split2"])
@pytest.mark.parametrize("lhs_shape,rhs_shape,dims,layout", BATCHED_CASES,
                         ids=[f"{a}x{b}-{d}" for a, b, d, _ in BATCHED_CASES])
def test_kernel_batched_and_broadcast_match_float64(rng, lhs_shape, rhs_shape, dims, layout, config, out_dtype):
    del layout
    scale = lambda s: tuple(d * 8 if d >= 16 else d for d in s)  # noqa: E731 - several tiles per entry
    lhs, rhs = _operands(rng, scale(lhs_shape), scale(rhs_shape), BF16)
    out_dtype = np.dtype(out_dtype or BF16)
    out = _poisoned_or_raises(lhs, rhs, dims, out_dtype, config)
    if out is not None:
        assert rel_error(out, _f64_dot(lhs, rhs, dims)) <= TOL[out_dtype]


def _compiled_kernel_calls(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().as_text().count(f'custom_call_target="{gemm.KERNEL_TARGET}"')


@pytest.mark.gpu
def test_vmap_and_grad_run_the_kernel(rng):
    x, w = random_array(rng, (4, 3, 256, 128), BF16), random_array(rng, (4, 3, 128, 192), BF16)
    f = jax.vmap(jax.vmap(jax_tma.matmul))
    assert _compiled_kernel_calls(f, x, w) == 1
    assert rel_error(f(x, w), _f64_dot(x, w, (((3,), (2,)), ((0, 1), (0, 1))))) <= TOL[BF16]

    x, w = random_array(rng, (512, 256), BF16), random_array(rng, (256, 384), BF16)
    step = jax.value_and_grad(_dense_loss, (0, 1))
    assert _compiled_kernel_calls(step, x, w) == 3
    _, (gx, gw) = step(x, w)
    y = np.asarray(jax_tma.dot_general(x, w, MATMUL), np.float64)
    gy = 2 * y
    assert rel_error(gx, gy @ np.asarray(w, np.float64).T) <= 2 * TOL[BF16]
    assert rel_error(gw, np.asarray(x, np.float64).T @ gy) <= 2 * TOL[BF16]


# ---------------------------------------------------------------- precision (CPU)
# The kernel multiplies the 16-bit operands as they are and accumulates in fp32: only the
# precisions that ask for that take it (gemm.kernel_precision); every other one is lax's,
# which computes it (F16_F16_F16 rounds bf16 operands to fp16: 1e5 overflows to inf) or raises
# (algorithms the CPU does not have, fp8 algorithms on 16-bit operands).

PRESET = lax.DotAlgorithmPreset
PRECISION_CASES = [
    # (operand dtype, precision, kernel on CUDA)
    (BF16, None, True),
    (BF16, lax.Precision.DEFAULT, True),
    (BF16, lax.Precision.HIGHEST, True),
    (F16, (lax.Precision.HIGH, lax.Precision.HIGHEST), True),
    (BF16, "float32", True),
    (BF16, PRESET.DEFAULT, True),
    (BF16, PRESET.BF16_BF16_F32, True),
    (BF16, "BF16_BF16_F32", True),
    (F16, PRESET.F16_F16_F32, True),
    (BF16, lax.DotAlgorithm(BF16, BF16, np.float32), True),
    (BF16, PRESET.F16_F16_F32, False),
    (BF16, PRESET.F16_F16_F16, False),
    (BF16, PRESET.BF16_BF16_BF16, False),
    (BF16, PRESET.TF32_TF32_F32, False),
    (BF16, PRESET.ANY_F8_ANY_F8_F32, False),
    (BF16, PRESET.BF16_BF16_F32_X3, False),
    (F16, PRESET.BF16_BF16_F32, False),
    (F16, PRESET.F16_F16_F16, False),
    (BF16, lax.DotAlgorithm(F16, F16, np.float32), False),
    (BF16, lax.DotAlgorithm(BF16, BF16, BF16), False),
    (BF16, lax.DotAlgorithm(BF16, BF16, np.float32, num_primitive_operations=3), False),
]
PRECISION_IDS = [f"{d.name}-{p}" for d, p, _ in PRECISION_CASES]


def _result_or_error(fn):
    try:
        out = fn()
        return ("ok", out.dtype, np.asarray(out, np.float64))
    except Exception as err:  # noqa: BLE001 - the error is the result being compared
        return ("error", type(err), str(err))


def _assert_same(ours, ref):
    assert ours[:2] == ref[:2], (ours, ref)
    if ours[0] == "ok":
        np.testing.assert_array_equal(ours[2], ref[2])
    else:
        assert ours[2] == ref[2]


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("preferred", [None, F32])
@pytest.mark.parametrize("dtype,precision,kernel", PRECISION_CASES, ids=PRECISION_IDS)
def test_precision_matches_lax(rng, dtype, precision, kernel, preferred):
    """bf16 values of 1e5 and more (past fp16's range) tell an fp16 rounding from none."""
    del kernel
    lhs = (random_array(rng, (8, 16), np.float32) * (1e5 if dtype == BF16 else 1e2)).astype(dtype)
    rhs = random_array(rng, (16, 4), np.float32).astype(dtype)
    ours = _result_or_error(lambda: jax_tma.dot_general(lhs, rhs, MATMUL, precision=precision,
                                                        preferred_element_type=preferred))
    ref = _result_or_error(lambda: lax.dot_general(lhs, rhs, MATMUL, precision=precision,
                                                   preferred_element_type=preferred))
    _assert_same(ours, ref)
    ours = _result_or_error(lambda: jax_tma.matmul(lhs, rhs, precision=precision, preferred_element_type=preferred))
    ref = _result_or_error(lambda: jnp.matmul(lhs, rhs, precision=precision, preferred_element_type=preferred))
    _assert_same(ours, ref)


@pytest.mark.usefixtures("on_cpu")
def test_bf16_with_f16_algorithm_overflows_as_lax_does():
    """Issue 30: bf16 1e5 values with F16_F16_F16 are inf in lax (fp16 operands), not 798720."""
    x = jnp.full((4, 8), 1e5, BF16)
    ours = jax_tma.dot_general(x, x.T, MATMUL, precision=PRESET.F16_F16_F16)
    assert np.isinf(np.asarray(ours, np.float32)).all()


# The kernel's precisions, and one of each other kind (computed, refused on the CPU).
GRADIENT_PRECISION_CASES = [c for c in PRECISION_CASES if c[2]] + [
    (BF16, PRESET.F16_F16_F16, False), (BF16, PRESET.F16_F16_F32, False),
    (F16, PRESET.BF16_BF16_F32, False)]


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("dtype,precision,kernel", GRADIENT_PRECISION_CASES,
                         ids=[f"{d.name}-{p}" for d, p, _ in GRADIENT_PRECISION_CASES])
def test_precision_gradients_match_lax(rng, dtype, precision, kernel):
    """The rules carry the precision into the gradient products, as lax's do."""
    del kernel
    x, w = random_array(rng, (8, 16), dtype), random_array(rng, (16, 4), dtype)
    loss = lambda dot: lambda x, w: jnp.sum(dot(x, w, MATMUL, precision=precision).astype(F32) ** 2)  # noqa: E731
    ours = _result_or_error(lambda: jnp.stack([jnp.sum(g.astype(F32)) for g in jax.grad(loss(jax_tma.dot_general), (0, 1))(x, w)]))
    ref = _result_or_error(lambda: jnp.stack([jnp.sum(g.astype(F32)) for g in jax.grad(loss(lax.dot_general), (0, 1))(x, w)]))
    _assert_same(ours, ref)


@needs_extension
@pytest.mark.parametrize("dtype,precision,kernel", PRECISION_CASES, ids=PRECISION_IDS)
def test_cuda_lowering_takes_the_kernel_only_for_its_precisions(dtype, precision, kernel):
    f = lambda x, y: jax_tma.dot_general(x, y, MATMUL, precision=precision)  # noqa: E731
    try:
        hlo = cuda_hlo(f, spec((64, 32), dtype), spec((32, 48), dtype))
    except ValueError as err:  # lax's own lowering refuses fp8 algorithms on 16-bit operands
        assert not kernel
        with pytest.raises(ValueError) as ref:
            cuda_hlo(lambda x, y: lax.dot_general(x, y, MATMUL, precision=precision),
                     spec((64, 32), dtype), spec((32, 48), dtype))
        assert str(err) == str(ref.value)
        return
    assert hlo.count(KERNEL_CALL) == int(kernel)
    assert ("stablehlo.dot_general" in hlo) == (not kernel)
    if not kernel:  # lax's algorithm reaches XLA's dot
        ref = cuda_hlo(lambda x, y: lax.dot_general(x, y, MATMUL, precision=precision),
                       spec((64, 32), dtype), spec((32, 48), dtype))
        algorithms = re.findall(r"algorithm = <[^>]*>", ref)
        assert algorithms and all(a in hlo for a in algorithms)


@needs_extension
def test_cuda_lowering_reads_the_default_matmul_precision():
    """precision=None is jax_default_matmul_precision, as in lax."""
    with jax.default_matmul_precision("F16_F16_F16"):
        hlo = cuda_hlo(lambda x, y: jax_tma.dot_general(x, y, MATMUL), spec((64, 32)), spec((32, 48)))
    assert KERNEL_CALL not in hlo and "stablehlo.dot_general" in hlo
    with jax.default_matmul_precision("BF16_BF16_F32"):
        hlo = cuda_hlo(lambda x, y: jax_tma.dot_general(x, y, MATMUL), spec((64, 32)), spec((32, 48)))
    assert hlo.count(KERNEL_CALL) == 1


# ---------------------------------------------------------------- lax's arguments (CPU)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("lhs_shape,rhs_shape", [((4, 8), (8, 2)), ((8,), (8, 2)), ((4, 8), (8,)),
                                                  ((8,), (8,)), ((2, 4, 8), (8, 2)), ((4, 8), (4, 2))])
@pytest.mark.parametrize("dims", [None, ((1, 0), ((), ())), (((1,), 0), ([], ()))],
                         ids=["none", "bare-ints", "mixed"])
def test_dimension_numbers_as_lax_reads_them(rng, lhs_shape, rhs_shape, dims):
    """None (un-batched matrix/vector products) and bare ints, as lax.dot_general takes them."""
    if dims is not None and (len(lhs_shape) != 2 or len(rhs_shape) != 2):
        dims = (((len(lhs_shape) - 1),), 0), ((), ())
    lhs, rhs = _operands(rng, lhs_shape, rhs_shape, BF16)
    _assert_same(_result_or_error(lambda: jax_tma.dot_general(lhs, rhs, dims)),
                 _result_or_error(lambda: lax.dot_general(lhs, rhs, dims)))


@needs_extension
def test_cuda_lowering_dimension_numbers_none():
    hlo = cuda_hlo(lambda x, y: jax_tma.dot_general(x, y, None), spec((64, 32)), spec((32, 48)))
    _assert_kernels(hlo, 1)


@pytest.mark.parametrize("bad", [[1.0, 2.0], "ab", None, {"a": 1}], ids=["list", "str", "none", "dict"])
@pytest.mark.parametrize("position", [0, 1])
def test_non_array_operands_raise_lax_errors(bad, position):
    good = jnp.ones((2,), BF16)
    args = (bad, good) if position == 0 else (good, bad)
    dims = (((0,), (0,)), ((), ()))
    with pytest.raises(Exception) as ref:
        lax.dot_general(*args, dims)
    with pytest.raises(type(ref.value)) as ours:
        jax_tma.dot_general(*args, dims)
    assert str(ours.value) == str(ref.value)
    assert "functools.partial" not in str(ours.value)


# ---------------------------------------------------------------- one kernel (CPU)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (1, None), (None, 2)])
def test_nested_vmap_one_operand_matches_lax(rng, in_axes):
    x = random_array(rng, _mapped_shape((2, 16, 8), in_axes[0]), BF16)
    w = random_array(rng, _mapped_shape((2, 8, 12), in_axes[1]), BF16)
    ours = jax.vmap(jax.vmap(jax_tma.matmul), in_axes)(x, w)
    ref = jax.vmap(jax.vmap(jnp.matmul), in_axes)(x, w)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(ours, np.float64), np.asarray(ref, np.float64))


@needs_extension
@pytest.mark.parametrize("in_axes", [(0, None), (None, 0)])
def test_cuda_lowering_nested_vmap_one_operand_is_one_kernel(in_axes):
    """vmap(vmap(matmul), (0, None)): the unmapped operand is broadcast along the outer axis
    (fewer elements than transposing the mapped one and moving the result), so both are
    batched: one kernel, no transposes."""
    f = jax.vmap(jax.vmap(jax_tma.matmul), in_axes)
    x, w = spec(_mapped_shape((2, 64, 32), in_axes[0])), spec(_mapped_shape((2, 32, 48), in_axes[1]))
    hlo = cuda_hlo(f, x, w)
    _assert_kernels(hlo, 1)
    assert "batch = 6 :" in hlo and "stablehlo.broadcast_in_dim" in hlo


@needs_extension
def test_cuda_lowering_nested_vmap_transposes_when_that_copies_less():
    """Two-row products under vmap(vmap(f), (0, None)): broadcasting the 64 x 64 matrices 8
    times costs more than transposing the rows: one transpose, one kernel."""
    f = jax.vmap(jax.vmap(jax_tma.matmul), (0, None))
    hlo = cuda_hlo(f, spec((8, 2, 2, 64)), spec((2, 64, 64)))
    assert hlo.count(KERNEL_CALL) == 1 and "stablehlo.dot_general" not in hlo
    before = hlo.rpartition(KERNEL_CALL)[0]
    assert before.count("stablehlo.transpose") == 1 and "stablehlo.broadcast_in_dim" not in before


def _weak_bf16(shape):
    return jax._src.lax.lax._convert_element_type(jnp.ones(shape, F32), BF16, weak_type=True)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("weak", ["lhs", "rhs", "both"])
@pytest.mark.parametrize("op", ["matmul", "dot_general"])
def test_weak_typed_operands_match_lax(rng, weak, op):
    x = jnp.asarray(random_array(rng, (16, 8), BF16))
    w = jnp.asarray(random_array(rng, (8, 12), BF16))
    if weak in ("lhs", "both"):
        x = jax._src.lax.lax._convert_element_type(x, BF16, weak_type=True)
    if weak in ("rhs", "both"):
        w = jax._src.lax.lax._convert_element_type(w, BF16, weak_type=True)
    ours_fn, ref_fn = ((jax_tma.matmul, jnp.matmul) if op == "matmul" else
                       (functools.partial(jax_tma.dot_general, dimension_numbers=MATMUL),
                        functools.partial(lax.dot_general, dimension_numbers=MATMUL)))
    ours, ref = ours_fn(x, w), ref_fn(x, w)
    assert (ours.dtype, ours.weak_type) == (ref.dtype, ref.weak_type)
    np.testing.assert_array_equal(np.asarray(ours, np.float64), np.asarray(ref, np.float64))


@needs_extension
@pytest.mark.parametrize("weak", ["lhs", "rhs", "both"])
@pytest.mark.parametrize("op", ["matmul", "dot_general"])
def test_cuda_lowering_weak_typed_operands_are_one_kernel(weak, op):
    dot = jax_tma.matmul if op == "matmul" else functools.partial(jax_tma.dot_general, dimension_numbers=MATMUL)

    def f(x, w):
        if weak in ("lhs", "both"):
            x = jax._src.lax.lax._convert_element_type(x, BF16, weak_type=True)
        if weak in ("rhs", "both"):
            w = jax._src.lax.lax._convert_element_type(w, BF16, weak_type=True)
        return dot(x, w)

    assert cuda_hlo(f, spec((64, 32)), spec((32, 48))).count(KERNEL_CALL) == 1


@pytest.mark.usefixtures("on_cpu")
def test_mixed_operand_types_that_lax_converts_match_lax(rng):
    """bf16 x weak fp32 (jnp.matmul's bf16 result) and bf16 x fp16 into bf16: lax converts both
    operands to the output type, and so does the kernel path."""
    x = jnp.asarray(random_array(rng, (16, 8), BF16))
    w32 = jax._src.lax.lax._convert_element_type(random_array(rng, (8, 12), F32), F32, weak_type=True)
    w16 = jnp.asarray(random_array(rng, (8, 12), F16))
    for ours, ref in [(jax_tma.matmul(x, w32), jnp.matmul(x, w32)),
                      (jax_tma.dot_general(x, w16, MATMUL), lax.dot_general(x, w16, MATMUL)),
                      (jax_tma.dot_general(w16, x.T, (((0,), (0,)), ((), ())), preferred_element_type=F16),
                       lax.dot_general(w16, x.T, (((0,), (0,)), ((), ())), preferred_element_type=F16))]:
        assert (ours.dtype, ours.weak_type) == (ref.dtype, ref.weak_type)
        np.testing.assert_array_equal(np.asarray(ours, np.float64), np.asarray(ref, np.float64))


@needs_extension
def test_cuda_lowering_mixed_operand_types_that_lax_converts():
    w32 = jax.ShapeDtypeStruct((32, 48), F32, weak_type=True)
    hlo = cuda_hlo(jax_tma.matmul, spec((64, 32)), w32)
    assert hlo.count(KERNEL_CALL) == 1
    hlo = cuda_hlo(lambda x, y: jax_tma.dot_general(x, y, MATMUL), spec((64, 32)), spec((32, 48), F16))
    assert hlo.count(KERNEL_CALL) == 1
    # bf16 x fp16 into fp32 (jnp.matmul's promotion): lax computes in fp32, XLA's dot.
    hlo = cuda_hlo(jax_tma.matmul, spec((64, 32)), spec((32, 48), F16))
    assert KERNEL_CALL not in hlo


REORDERED_CASES = [
    # (lhs shape, rhs shape, dims, the operand transposed: the smaller one, or both)
    ((64, 4, 8), (8, 4, 48), (((1, 2), (1, 0)), ((), ())), "rhs"),
    ((16, 4, 8), (8, 4, 480), (((1, 2), (1, 0)), ((), ())), "lhs"),
    ((2, 64, 4, 8), (2, 8, 4, 48), (((2, 3), (2, 1)), ((0,), (0,))), "rhs"),
    ((64, 4, 8), (48, 8, 4), (((1, 2), (2, 1)), ((), ())), "rhs"),
    ((32, 16, 4), (32, 24, 4), (((0,), (0,)), ((2,), (2,))), "both"),  # batch innermost in both
]


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("lhs_shape,rhs_shape,dims,transposed", REORDERED_CASES)
def test_reordered_contracting_dims_match_lax(rng, lhs_shape, rhs_shape, dims, transposed):
    del transposed
    lhs, rhs = _operands(rng, lhs_shape, rhs_shape, BF16)
    ours, ref = jax_tma.dot_general(lhs, rhs, dims), lax.dot_general(lhs, rhs, dims)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(ours, np.float64), np.asarray(ref, np.float64))
    ours = jax.grad(lambda x, y: jnp.sum(jax_tma.dot_general(x, y, dims).astype(F32) ** 2), (0, 1))(lhs, rhs)
    ref = jax.grad(lambda x, y: jnp.sum(lax.dot_general(x, y, dims).astype(F32) ** 2), (0, 1))(lhs, rhs)
    for o, r in zip(ours, ref):
        assert rel_error(o, r) <= 2 * TOL[BF16]


@needs_extension
@pytest.mark.parametrize("lhs_shape,rhs_shape,dims,transposed", REORDERED_CASES)
def test_cuda_lowering_reordered_contracting_dims_transpose_one_operand(lhs_shape, rhs_shape, dims, transposed):
    """Contracting dims in opposite orders cannot be read in place: the smaller operand is
    transposed once, then one kernel (both, where each has its batch axis innermost)."""
    assert gemm_plan.plan(lhs_shape, rhs_shape, dims) is None
    hlo = cuda_hlo(lambda x, y: jax_tma.dot_general(x, y, dims), spec(lhs_shape), spec(rhs_shape))
    assert hlo.count(KERNEL_CALL) == 1 and "stablehlo.dot_general" not in hlo
    before = hlo.rpartition(KERNEL_CALL)[0]
    transposes = [line.split("->")[0] for line in before.splitlines() if "stablehlo.transpose" in line]
    expected = {"lhs": [lhs_shape], "rhs": [rhs_shape], "both": [lhs_shape, rhs_shape]}[transposed]
    assert len(transposes) == len(expected)
    for line, shape in zip(transposes, expected):
        assert f"tensor<{'x'.join(map(str, shape))}xbf16>" in line
    route = gemm.kernel_route(spec(lhs_shape), spec(rhs_shape), dims, BF16)
    assert (route.lhs_perm is not None, route.rhs_perm is not None) == (
        transposed in ("lhs", "both"), transposed in ("rhs", "both"))


@needs_extension
def test_cuda_lowering_free_dims_over_axes_with_odd_rows():
    """DenseGeneral into (heads, 7) features: B's rows span two axes and are not 16-byte
    multiples. The free dims merge into one (a reshape, no copy) and are padded once: one
    kernel, no transpose."""
    dims = (((2,), (0,)), ((), ()))
    f = lambda x, w: jax_tma.dot_general(x, w, dims)  # noqa: E731
    assert gemm_plan.plan((2, 16, 64), (64, 12, 7), dims) is None
    hlo = cuda_hlo(f, spec((2, 16, 64)), spec((64, 12, 7)))
    assert hlo.count(KERNEL_CALL) == 1 and "stablehlo.dot_general" not in hlo
    before = hlo.rpartition(KERNEL_CALL)[0]
    assert "stablehlo.transpose" not in before and "stablehlo.pad" in hlo
    route = gemm.kernel_route(spec((2, 16, 64)), spec((64, 12, 7)), dims, BF16)
    assert not route.copies and route.rhs_shape == (1, 64, 84)


@pytest.mark.usefixtures("on_cpu")
def test_free_dims_over_axes_with_odd_rows_match_lax(rng):
    dims = (((2,), (0,)), ((), ()))
    x, w = _operands(rng, (2, 16, 64), (64, 12, 7), BF16)
    np.testing.assert_array_equal(np.asarray(jax_tma.dot_general(x, w, dims), np.float64),
                                  np.asarray(lax.dot_general(x, w, dims), np.float64))


# ---------------------------------------------------------------- issue 30 on the GPU


def _finite_close(ours, ref, bound) -> bool:
    """Same infinities and NaNs, finite values within `bound` (Frobenius, relative)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if not np.array_equal(np.isnan(ours), np.isnan(ref)) or not np.array_equal(ours[np.isinf(ours)], ref[np.isinf(ref)]):
        return False
    finite = np.isfinite(ref)
    return rel_error(ours[finite], ref[finite]) <= bound if finite.any() else True


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision,kernel", PRECISION_CASES, ids=PRECISION_IDS)
def test_precision_on_gpu(rng, dtype, precision, kernel):
    """The kernel runs exactly for its precisions (within the dtype's bound of float64); every
    other precision gives lax's result on the GPU, or lax's error."""
    scale = 1e5 if dtype == BF16 else 1e2  # bf16 past fp16's range: tells fp16 rounding apart
    lhs = (random_array(rng, (256, 512), np.float32) * scale).astype(dtype)
    rhs = random_array(rng, (512, 384), np.float32).astype(dtype)
    ours_fn = jax.jit(lambda x, y: jax_tma.dot_general(x, y, MATMUL, precision=precision))
    ref_fn = jax.jit(lambda x, y: lax.dot_general(x, y, MATMUL, precision=precision))
    ours, ref = _result_or_error(lambda: ours_fn(lhs, rhs)), _result_or_error(lambda: ref_fn(lhs, rhs))
    assert ours[0] == ref[0], (ours, ref)
    if ours[0] == "error":  # lax's Python errors word for word; XLA's compile errors by type
        assert ours[1] == ref[1]
        if ours[1] in (ValueError, TypeError):
            assert ours[2] == ref[2]
        return
    assert ours[1] == ref[1]
    assert _compiled_kernel_calls(lambda x, y: jax_tma.dot_general(x, y, MATMUL, precision=precision),
                                  lhs, rhs) == int(kernel)
    if kernel:
        assert rel_error(ours[2], _f64_dot(lhs, rhs, MATMUL)) <= TOL[dtype]
    assert _finite_close(ours[2], ref[2], TOL[dtype])


ROUTE_GPU_CASES = [
    # (lhs shape, rhs shape, dims): products the kernel computes after a transpose or a merge
    ((640, 4, 72), (72, 4, 480), (((1, 2), (1, 0)), ((), ()))),
    ((128, 4, 72), (72, 4, 4000), (((1, 2), (1, 0)), ((), ()))),
    ((2, 640, 4, 72), (2, 72, 4, 480), (((2, 3), (2, 1)), ((0,), (0,)))),
    ((256, 160, 4), (256, 200, 4), (((0,), (0,)), ((2,), (2,)))),
    ((2, 160, 512), (512, 12, 7), (((2,), (0,)), ((), ()))),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, jax_tma.GemmConfig(64, 128, 8, 1), jax_tma.GemmConfig(128, 128, 6, 1, split_k=2)],
                         ids=["default", "m64", "split2"])
@pytest.mark.parametrize("lhs_shape,rhs_shape,dims", ROUTE_GPU_CASES)
def test_kernel_routes_match_float64(rng, lhs_shape, rhs_shape, dims, config):
    """Transposed or merged operands (gemm.kernel_route) over NaN-filled outputs."""
    lhs, rhs = _operands(rng, lhs_shape, rhs_shape, BF16)
    assert gemm_plan.plan(lhs_shape, rhs_shape, dims) is None
    for out_dtype in (BF16, F32):
        out = np.asarray(_testing.gemm_poisoned(lhs, rhs, out_dtype, config=config, dimension_numbers=dims))
        assert not np.isnan(out).any(), "kernel left poisoned (unwritten) outputs"
        assert rel_error(out, _f64_dot(lhs, rhs, dims)) <= TOL[out_dtype]
    f = lambda x, y: jax_tma.dot_general(x, y, dims)  # noqa: E731
    assert _compiled_kernel_calls(f, lhs, rhs) == 1


@pytest.mark.gpu
def test_nested_vmap_weak_and_mixed_operands_run_the_kernel(rng):
    """Issue 30: vmap(vmap(matmul), (0, None)) and (None, 0), weak-typed bf16 operands and
    bf16 x weak fp32 (which lax converts to bf16): one kernel call each, within the bf16
    bound of float64."""
    f64 = lambda v: np.asarray(v, np.float64)  # noqa: E731
    x, w = random_array(rng, (3, 4, 256, 128), BF16), random_array(rng, (4, 128, 192), BF16)
    u = random_array(rng, (4, 96, 256), BF16)
    for in_axes, args, exact in [
        ((0, None), (x, w), np.einsum("abmk,bkn->abmn", f64(x), f64(w))),
        ((None, 0), (u, x), np.einsum("bmk,abkn->abmn", f64(u), f64(x))),
    ]:
        f = jax.vmap(jax.vmap(jax_tma.matmul), in_axes)
        assert _compiled_kernel_calls(f, *args) == 1
        assert rel_error(jax.jit(f)(*args), exact) <= TOL[BF16]

    def weak(v, dtype=BF16):
        return jax._src.lax.lax._convert_element_type(v, dtype, weak_type=True)

    a, b = random_array(rng, (512, 256), BF16), random_array(rng, (256, 384), BF16)
    for f in (lambda a, b: jax_tma.matmul(weak(a), b), lambda a, b: jax_tma.matmul(weak(a), weak(b)),
              lambda a, b: jax_tma.matmul(a, weak(b.astype(F32), F32))):
        assert _compiled_kernel_calls(f, a, b) == 1
        assert rel_error(jax.jit(f)(a, b), f64(a) @ f64(b)) <= TOL[BF16]
