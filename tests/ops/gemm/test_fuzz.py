"""Property-based tests (hypothesis) of jax_tma.dot_general and matmul.

Products are drawn with every dimension in 1..5000 (aligned to 8 or 64 elements or not), bf16
or fp16 operands, outputs of the input type or fp32, operand axes in any order (the four
layouts, batch axes anywhere, free and contracting dims over two axes in either order), batch
dims and vmap. Element counts are bounded so that each case stays small.

On the CPU (fast, in CI, a fixed derandomized sequence):
- ``dot_general`` and ``matmul`` against ``lax.dot_general`` / ``jnp.matmul``: shape, dtype and
  weak type equal, values within the per-dtype bound against |lhs| . |rhs|; under vmap too;
- the kernel's view of each product (``gemm.kernel_route``: transposes, pads and strides),
  walked in float64 numpy, computes the product exactly;
- the CUDA lowering holds one kernel call exactly when the kernel takes the product.

On a Hopper GPU (``-m fuzz``, also marked ``gpu``): thousands of products through the kernel
over NaN-filled outputs with random legal configurations (split-K and stream-K included),
against a float64 reference with the bounds of tests/ops/gemm/test_gemm.py (bf16 1e-2, fp16 2e-3,
fp32 output 1e-5, Frobenius-norm relative error). ``JAX_TMA_FUZZ_EXAMPLES`` sets how many
(default 2000; each case compiles its own executable, which takes most of the time);
``JAX_TMA_FUZZ_SEED`` draws another sequence than the fixed default one.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import jax_tma  # noqa: E402
from jax_tma import _testing  # noqa: E402
from jax_tma.ops.gemm import config as gemm_config  # noqa: E402
from jax_tma.ops.gemm import plan as gemm_plan  # noqa: E402
from jax_tma.ops.gemm import primitive as gemm  # noqa: E402
from support import cuda_hlo, needs_extension  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
TOL = {BF16: 1e-2, F16: 2e-3, F32: 1e-5}
MAX_DIM = 5000

CPU_SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_GPU_SEED = os.environ.get("JAX_TMA_FUZZ_SEED")
GPU_SETTINGS = dict(deadline=None, derandomize=_GPU_SEED is None, database=None, print_blob=True,
                    max_examples=int(os.environ.get("JAX_TMA_FUZZ_EXAMPLES", "2000")),
                    suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------- strategies


@st.composite
def sizes(draw, count: int, budget: int) -> list[int]:
    """`count` sizes in 1..MAX_DIM whose product is at most `budget`: small, aligned to 8 or
    64, near a tile edge, or anything."""
    out = []
    for _ in range(count):
        top = max(1, min(MAX_DIM, budget))
        kind = draw(st.sampled_from(["small", "any", "aligned8", "aligned64", "edge"]))
        if kind == "small":
            size = draw(st.integers(1, min(top, 16)))
        elif kind == "aligned8" and top >= 8:
            size = 8 * draw(st.integers(1, top // 8))
        elif kind == "aligned64" and top >= 64:
            size = 64 * draw(st.integers(1, top // 64))
        elif kind == "edge":
            size = min(top, draw(st.sampled_from([63, 64, 65, 127, 128, 129, 255, 256, 257, 4095, 4096, 4097])))
        else:
            size = draw(st.integers(1, top))
        out.append(size)
        budget //= size
    return out


@st.composite
def products(draw, budget: int, in_place_only: bool = False, max_batch_axes: int = 2,
             elements: int | None = None):
    """(lhs shape, rhs shape, dimension numbers, m, n, k, batch) of a dot_general whose
    batch * m * n * k is at most `budget`, and each operand and the output at most `elements`
    (default: `budget`). With `in_place_only`, every group of dims is one axis in an order
    the kernel reads in place (the four layouts; batch axes leading)."""
    elements = budget if elements is None else elements
    nb = draw(st.integers(0, 1 if in_place_only else max_batch_axes))
    nm = draw(st.integers(0, 1) if not in_place_only else st.just(1))
    nn = draw(st.integers(0, 2) if not in_place_only else st.just(1))
    nk = draw(st.integers(1, 1 if in_place_only else 2))
    if not in_place_only and draw(st.integers(0, 9)) == 0:
        nk = 0  # an outer product
    if not in_place_only and nm == 1:
        nm = draw(st.integers(1, 2))
    batch = draw(sizes(nb, 16)) if nb else []
    k_sizes = draw(sizes(nk, min(budget, elements))) if nk else []
    k = int(np.prod(k_sizes))
    m_sizes = draw(sizes(nm, max(1, min(budget, elements) // k))) if nm else []
    m = int(np.prod(m_sizes))
    n_sizes = draw(sizes(nn, max(1, min(budget // (k * m), elements // k, elements // m)))) if nn else []
    n = int(np.prod(n_sizes))
    b = int(np.prod(batch))
    if b * m * n * k > budget or b * max(m * k, n * k, m * n) > elements:
        batch, b = [], 1
    lhs_labels = [("b", i) for i in range(len(batch))] + [("f", i) for i in range(nm)] + [("c", i) for i in range(nk)]
    rhs_labels = [("b", i) for i in range(len(batch))] + [("c", i) for i in range(nk)] + [("g", i) for i in range(nn)]
    if in_place_only:
        lhs_order = lhs_labels if draw(st.booleans()) else [*lhs_labels[:len(batch)], ("c", 0), ("f", 0)]
        rhs_order = rhs_labels if draw(st.booleans()) else [*rhs_labels[:len(batch)], ("g", 0), ("c", 0)]
    else:
        lhs_order = lhs_labels if draw(st.booleans()) else draw(st.permutations(lhs_labels))
        rhs_order = rhs_labels if draw(st.booleans()) else draw(st.permutations(rhs_labels))
    size_of = {("b", i): s for i, s in enumerate(batch)}
    size_of.update({("f", i): s for i, s in enumerate(m_sizes)})
    size_of.update({("g", i): s for i, s in enumerate(n_sizes)})
    size_of.update({("c", i): s for i, s in enumerate(k_sizes)})
    lhs_shape = tuple(size_of[x] for x in lhs_order)
    rhs_shape = tuple(size_of[x] for x in rhs_order)
    # Pairs in a drawn order: it sets the output's batch order and nothing else.
    c_pairs = draw(st.permutations(range(nk)))
    b_pairs = list(range(len(batch))) if in_place_only else draw(st.permutations(range(len(batch))))
    dims = ((tuple(lhs_order.index(("c", i)) for i in c_pairs), tuple(rhs_order.index(("c", i)) for i in c_pairs)),
            (tuple(lhs_order.index(("b", i)) for i in b_pairs), tuple(rhs_order.index(("b", i)) for i in b_pairs)))
    return lhs_shape, rhs_shape, dims, m, n, k, b


dtypes_and_outputs = st.sampled_from([(BF16, None), (F16, None), (BF16, F32), (F16, F32), (BF16, BF16)])


def _operands(seed: int, lhs_shape, rhs_shape, dtype):
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal(lhs_shape, dtype=np.float32).astype(dtype)
    rhs = rng.standard_normal(rhs_shape, dtype=np.float32).astype(dtype)
    return lhs, rhs


def _f64_dot(lhs, rhs, dims) -> np.ndarray:
    """dot_general in float64, output dims in lax's order: both operands transposed to
    [batch, free, contracting] / [batch, contracting, free] and multiplied by BLAS."""
    (lc, rc), (lb, rb) = dims
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    lf = [i for i in range(lhs.ndim) if i not in lc and i not in lb]
    rf = [j for j in range(rhs.ndim) if j not in rc and j not in rb]
    size = lambda x, axes: int(np.prod([x.shape[a] for a in axes]))  # noqa: E731
    batch, k = size(lhs, lb), size(lhs, lc)
    a = np.transpose(lhs, (*lb, *lf, *lc)).reshape(batch, size(lhs, lf), k)
    b = np.transpose(rhs, (*rb, *rc, *rf)).reshape(batch, k, size(rhs, rf))
    out_shape = (*(lhs.shape[i] for i in lb), *(lhs.shape[i] for i in lf), *(rhs.shape[j] for j in rf))
    return np.matmul(a, b).reshape(out_shape)


def _bound_error(out, lhs, rhs, dims) -> float:
    """Largest error relative to |lhs| . |rhs| (a scale cancellation cannot shrink), or to the
    output type's smallest normal number where the scale is below it (subnormal outputs are
    rounded in absolute terms)."""
    exact = _f64_dot(lhs, rhs, dims)
    scale = _f64_dot(np.abs(np.asarray(lhs, np.float64)), np.abs(np.asarray(rhs, np.float64)), dims)
    if exact.size == 0:
        return 0.0
    floor = float(ml_dtypes.finfo(np.dtype(out.dtype)).tiny)
    return float(np.max(np.abs(np.asarray(out, np.float64) - exact) / np.maximum(scale, floor)))


# ---------------------------------------------------------------- CPU: against lax


@settings(max_examples=30, **CPU_SETTINGS)
@given(product=products(budget=2**18), types=dtypes_and_outputs, seed=st.integers(0, 2**32 - 1),
       jit=st.booleans())
def test_fuzz_dot_general_matches_lax(product, types, seed, jit):
    lhs_shape, rhs_shape, dims, *_ = product
    dtype, preferred = types
    lhs, rhs = _operands(seed, lhs_shape, rhs_shape, dtype)
    ours_fn = functools.partial(jax_tma.dot_general, dimension_numbers=dims, preferred_element_type=preferred)
    if jit:
        ours_fn = jax.jit(ours_fn)
    ours = ours_fn(lhs, rhs)
    ref = lax.dot_general(lhs, rhs, dims, preferred_element_type=preferred)
    assert (ours.shape, ours.dtype, ours.weak_type) == (ref.shape, ref.dtype, ref.weak_type)
    assert _bound_error(ours, lhs, rhs, dims) <= 2 * TOL[np.dtype(ours.dtype)] + TOL[dtype]


@st.composite
def matmul_shapes(draw):
    """Operand shapes jnp.matmul takes: 1-D, 2-D, batched with broadcasting."""
    m, n, k = draw(sizes(3, 2**17))
    a_batch = draw(st.lists(st.integers(1, 3), max_size=2))
    b_batch = draw(st.lists(st.integers(1, 3), max_size=2))
    if draw(st.booleans()):  # equal batch shapes (the kernel's batch axis)
        b_batch = list(a_batch)
    a = [k] if draw(st.integers(0, 5)) == 0 else [*a_batch, m, k]
    b = [k] if draw(st.integers(0, 5)) == 0 else [*b_batch, k, n]
    return tuple(a), tuple(b)


@settings(max_examples=25, **CPU_SETTINGS)
@given(shapes=matmul_shapes(), types=dtypes_and_outputs, seed=st.integers(0, 2**32 - 1))
def test_fuzz_matmul_matches_jnp(shapes, types, seed):
    a_shape, b_shape = shapes
    dtype, preferred = types
    a, b = _operands(seed, a_shape, b_shape, dtype)
    try:
        ref = jnp.matmul(a, b, preferred_element_type=preferred)
    except (TypeError, ValueError) as err:  # batch shapes that do not broadcast
        with pytest.raises(type(err)) as ours:
            jax_tma.matmul(a, b, preferred_element_type=preferred)
        assert str(ours.value) == str(err)
        return
    ours = jax_tma.matmul(a, b, preferred_element_type=preferred)
    assert (ours.shape, ours.dtype, ours.weak_type) == (ref.shape, ref.dtype, ref.weak_type)
    exact = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    scale = np.matmul(np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64)))
    bound = 2 * TOL[np.dtype(ours.dtype)] + TOL[dtype]
    floor = float(ml_dtypes.finfo(np.dtype(ours.dtype)).tiny)  # subnormal outputs
    assert np.all(np.abs(np.asarray(ours, np.float64) - exact) <= bound * np.maximum(scale, floor))


@st.composite
def vmapped(draw):
    """A product under one or two vmaps, each mapping one operand or both at any axis
    (levels listed innermost first)."""
    lhs_shape, rhs_shape, dims, *_ = draw(products(budget=2**14, max_batch_axes=1))
    levels = draw(st.integers(1, 2))
    axes = []
    for _ in range(levels):
        which = draw(st.sampled_from(["lhs", "rhs", "both"]))
        size = draw(st.integers(1, 4))
        la = draw(st.integers(0, len(lhs_shape))) if which != "rhs" else None
        ra = draw(st.integers(0, len(rhs_shape))) if which != "lhs" else None
        if la is not None:
            lhs_shape = (*lhs_shape[:la], size, *lhs_shape[la:])
        if ra is not None:
            rhs_shape = (*rhs_shape[:ra], size, *rhs_shape[ra:])
        axes.append((la, ra))
    return lhs_shape, rhs_shape, dims, axes


def _vmap_nest(dot, dims, axes):
    """vmap levels in `axes` order, innermost first: axes[i] is where level i's axis sits in
    the operands that level receives (the inner levels' axes already in them)."""
    fn = functools.partial(dot, dimension_numbers=dims)
    for la, ra in axes:
        fn = jax.vmap(fn, in_axes=(la, ra))
    return fn


@settings(max_examples=25, **CPU_SETTINGS)
@given(case=vmapped(), types=dtypes_and_outputs, seed=st.integers(0, 2**32 - 1))
def test_fuzz_vmap_matches_lax(case, types, seed):
    lhs_shape, rhs_shape, dims, axes = case
    dtype, preferred = types
    lhs, rhs = _operands(seed, lhs_shape, rhs_shape, dtype)
    ours = _vmap_nest(functools.partial(jax_tma.dot_general, preferred_element_type=preferred), dims, axes)(lhs, rhs)
    ref = _vmap_nest(functools.partial(lax.dot_general, preferred_element_type=preferred), dims, axes)(lhs, rhs)
    assert (ours.shape, ours.dtype) == (ref.shape, ref.dtype)
    scale = np.abs(np.asarray(ref, np.float64)).max(initial=0.0) + 1e-30
    # Both are XLA's dot here; the rules only move axes (or broadcast an operand).
    np.testing.assert_allclose(np.asarray(ours, np.float64), np.asarray(ref, np.float64),
                               atol=4 * TOL[np.dtype(ours.dtype)] * scale, rtol=0)


@needs_extension
@settings(max_examples=40, **CPU_SETTINGS)
@given(case=vmapped())
def test_fuzz_cuda_lowering_vmap_is_one_product(case):
    """Every vmapped product lowers to one kernel call or one XLA dot (vmap never loops), and
    to the kernel where every vmap maps axis 0 of both operands of an un-batched product the
    kernel reads in place (each operand with more than one element outside the batch)."""
    lhs_shape, rhs_shape, dims, axes = case
    specs = (jax.ShapeDtypeStruct(lhs_shape, BF16), jax.ShapeDtypeStruct(rhs_shape, BF16))
    hlo = cuda_hlo(_vmap_nest(jax_tma.dot_general, dims, axes), *specs)
    kernels = hlo.count(f"custom_call @{gemm.KERNEL_TARGET}(")
    xla = hlo.count("stablehlo.dot_general")
    assert kernels + xla == 1, (kernels, xla)
    inner = (lhs_shape[len(axes):], rhs_shape[len(axes):])
    if (all(a == (0, 0) for a in axes) and not dims[1][0] and min(map(np.prod, inner)) > 1
            and gemm_plan.plan(*inner, dims) is not None):
        assert kernels == 1


# ---------------------------------------------------------------- CPU: the kernel's view


def _walk_route(lhs, rhs, route: gemm.KernelRoute, out_size: int) -> np.ndarray:
    """The kernel's result for `route` computed from its strides in float64 numpy: transpose,
    pad, then D[b, m, n] = sum_k A[b, m, k] B[b, k, n] read at the strides the kernel gets."""
    plan = route.plan

    def flat(x, perm, shape, view):
        x = np.asarray(x, np.float64)
        if perm is not None:
            x = np.transpose(x, perm)
        if shape is not None:
            x = x.reshape(shape)
        if view.pad:
            widths = [(0, 0)] * x.ndim
            widths[view.pad_axis] = (0, view.pad)
            x = np.pad(x, widths, constant_values=np.nan)  # a pad that is read poisons D
        return x.reshape(-1)

    a = flat(lhs, route.lhs_perm, route.lhs_shape, plan.lhs)
    b = flat(rhs, route.rhs_perm, route.rhs_shape, plan.rhs)
    d = np.full(out_size, np.nan)
    bi = np.arange(plan.batch)[:, None, None]
    mi = np.arange(plan.m)[None, :, None]
    ki = np.arange(plan.k)[None, None, :]
    av = a[bi * plan.lhs.batch_stride + mi * plan.lhs.outer_stride + ki * plan.lhs.k_stride]
    ni = np.arange(plan.n)[None, None, :]
    kj = np.arange(plan.k)[None, :, None]
    bv = b[bi * plan.rhs.batch_stride + kj * plan.rhs.k_stride + ni * plan.rhs.outer_stride]
    prod = np.matmul(av, bv)
    idx = (np.arange(plan.batch)[:, None, None] * plan.d_batch_stride
           + np.arange(plan.m)[None, :, None] * plan.d_m_stride + np.arange(plan.n)[None, None, :])
    assert len(np.unique(idx)) == idx.size, "two output elements at one address"
    d[idx.reshape(-1)] = prod.reshape(-1)
    return d


@settings(max_examples=80, **CPU_SETTINGS)
@given(product=products(budget=2**20), seed=st.integers(0, 2**32 - 1))
def test_fuzz_kernel_route_computes_the_product(product, seed):
    lhs_shape, rhs_shape, dims, m, n, k, batch = product
    spec = lambda s: jax.ShapeDtypeStruct(s, BF16)  # noqa: E731
    route = gemm.kernel_route(spec(lhs_shape), spec(rhs_shape), dims, BF16)
    # Every product has a route but those whose batch is an operand's only dimension of more
    # than one element (the kernel's unit stride must be K's or the free dimension's).
    assert (route is None) == (batch > 1 and k == 1 and (m == 1 or n == 1)), (lhs_shape, rhs_shape, dims)
    if route is None:
        return
    plan = route.plan
    assert (plan.m * plan.n * plan.batch, plan.k) == (m * n * batch, k)
    rng = np.random.default_rng(seed)
    lhs = rng.integers(-4, 5, lhs_shape).astype(np.float64)  # exact in float64 sums
    rhs = rng.integers(-4, 5, rhs_shape).astype(np.float64)
    expected = _f64_dot(lhs, rhs, dims)
    got = _walk_route(lhs, rhs, route, expected.size)
    np.testing.assert_array_equal(got, expected.reshape(-1))


@needs_extension
@settings(max_examples=60, **CPU_SETTINGS)
@given(product=products(budget=2**40, max_batch_axes=2), types=dtypes_and_outputs)
def test_fuzz_cuda_lowering_one_kernel_or_xla(product, types):
    """Any product, up to 5000 per dim and 2^40 multiply-adds: one kernel call where the
    kernel takes it (a route and a configuration), else XLA's dot; never both, never more."""
    lhs_shape, rhs_shape, dims, *_ = product
    dtype, preferred = types
    out = np.dtype(preferred or dtype)
    f = lambda x, y: jax_tma.dot_general(x, y, dims, preferred_element_type=preferred)  # noqa: E731
    specs = (jax.ShapeDtypeStruct(lhs_shape, dtype), jax.ShapeDtypeStruct(rhs_shape, dtype))
    hlo = cuda_hlo(f, *specs)
    route = gemm.kernel_route(*specs, dims, out)
    expected = route is not None and int(np.prod(gemm_plan.output_shape(lhs_shape, rhs_shape, dims))) > 0
    if expected:
        expected = gemm.config_for(route.plan, out, None) is not None
    assert hlo.count(f"custom_call @{gemm.KERNEL_TARGET}(") == int(expected)
    assert ("stablehlo.dot_general" in hlo) == (not expected)


# ---------------------------------------------------------------- GPU: against float64


@st.composite
def gpu_cases(draw):
    lhs_shape, rhs_shape, dims, *_ = draw(products(budget=2**28, elements=2**22))
    dtype, preferred = draw(dtypes_and_outputs)
    out = np.dtype(preferred or dtype)
    spec = lambda s: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
    route = gemm.kernel_route(spec(lhs_shape), spec(rhs_shape), dims, out)
    config = None
    if route is not None and draw(st.integers(0, 2)):
        legal = list(gemm_config.legal_configs(route.plan.m, route.plan.n, route.plan.k, out,
                                               gemm_plan.out_strides(route.plan), batch=route.plan.batch))
        config = draw(st.sampled_from(legal)) if legal else None
    return lhs_shape, rhs_shape, dims, dtype, out, config, draw(st.integers(0, 2**32 - 1))


_gpu_given = given(case=gpu_cases())
if _GPU_SEED is not None:
    _gpu_given = hypothesis.seed(int(_GPU_SEED))(_gpu_given)


@pytest.mark.gpu
@pytest.mark.fuzz
@settings(**GPU_SETTINGS)
@_gpu_given
def test_fuzz_kernel_matches_float64(case):
    lhs_shape, rhs_shape, dims, dtype, out_dtype, config, seed = case
    lhs, rhs = _operands(seed, lhs_shape, rhs_shape, dtype)
    try:
        out = _testing.gemm_poisoned(lhs, rhs, out_dtype, config=config, dimension_numbers=dims)
    except ValueError:
        # The kernel does not take this product (no route: XLA's), so nothing to check.
        assert gemm.kernel_route(lhs, rhs, dims, out_dtype) is None
        return
    out = np.asarray(out)
    assert not np.isnan(out).any(), "kernel left poisoned (unwritten) outputs"
    # The error against |lhs| . |rhs| (elementwise scale of each output): a long contraction
    # with cancellation (a scalar of K = 88256, fp32 out: 1.15e-5 relative to its own value)
    # is held to the accumulation's bound, not to a relative one it cannot meet.
    # fp32 outputs: the fp32 accumulation's own error grows as sqrt(K) (random rounding).
    k = math.prod(lhs_shape[a] for a in dims[0][0])
    bound = max(TOL[out_dtype], 4 * 2.0**-23 * math.sqrt(k)) if out_dtype == np.float32 else TOL[out_dtype]
    assert _bound_error(out, lhs, rhs, dims) <= bound, (config, lhs_shape, rhs_shape, dims)
