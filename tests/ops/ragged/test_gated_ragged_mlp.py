"""jax_tma.gated_ragged_mlp: results and gradients against float64 references computed in
numpy, errors, vmap, sharding, export, the CUDA lowering (the fused backward's kernel calls),
and the gated gradient grouped kernel on a Hopper GPU.

Error bounds (Frobenius-norm relative error against float64 on random data): bf16 2e-2, fp16
4e-3 for the result (the gated product's three roundings and the down product's); gradients 2x
those (the cotangents round once more before each backward product); float32 1e-5. The
gradient kernel alone (d_gate, d_up from dh = dy @ w_down^T and the saved pre-activations, each
rounded once after dh's rounding): bf16 1e-2, fp16 2e-3. GPU tests poison the kernel's outputs
(NaN) so that any element it does not write fails.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jax_tma
from jax_tma.ops.ragged import config as rd_config
from jax_tma.ops.ragged import gated_grad_primitive as ggp
from jax_tma.ops.ragged import gated_primitive as gp
from support import (cpu_mesh, cuda_hlo, f64_act, f64_act_grad, f64_ragged_contraction,
                     f64_ragged_rows, group_sizes, needs_extension, random_array, rel_error,
                     target_calls)

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
TOL = {BF16: 2e-2, F16: 4e-3, F32: 1e-5}
GRAD_KERNEL_TOL = {BF16: 1e-2, F16: 2e-3}
ACTIVATIONS = ["silu", "gelu", "gelu_erf"]
RAGGED_TARGET = "jax_tma_ragged_dot_sm90"


# ---------------------------------------------------------------- float64 references


def f64_mlp(x, wg, wu, wd, gs, activation):
    g, u = f64_ragged_rows(x, wg, gs), f64_ragged_rows(x, wu, gs)
    return f64_ragged_rows(f64_act(activation, g) * u, wd, gs)


def f64_mlp_vjp(x, wg, wu, wd, gs, dy, activation):
    """(dx, dwg, dwu, dwd) of sum(dy * mlp) in float64."""
    g, u = f64_ragged_rows(x, wg, gs), f64_ragged_rows(x, wu, gs)
    h = f64_act(activation, g) * u
    dh = f64_ragged_rows(dy, wd, gs, w_k_major=True)
    d_gate, d_up = dh * u * f64_act_grad(activation, g), dh * f64_act(activation, g)
    dx = (f64_ragged_rows(d_gate, wg, gs, w_k_major=True)
          + f64_ragged_rows(d_up, wu, gs, w_k_major=True))
    return dx, f64_ragged_contraction(x, d_gate, gs), f64_ragged_contraction(x, d_up, gs), f64_ragged_contraction(h, dy, gs)


def f64_gate_up_grads(dy, wd, gs, gate, up, activation):
    """(d_gate, d_up) of the gradient kernel in float64: dh = dy @ wd[g]^T per group."""
    dh = f64_ragged_rows(dy, wd, gs, w_k_major=True)
    gate, up = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    return dh * up * f64_act_grad(activation, gate), dh * f64_act(activation, gate)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _operands(rng, m, d, f, g, dtype, d_out=None):
    """x [M, D], w_gate and w_up [G, D, F], w_down [G, F, D'], scaled so that the
    pre-activations spread over the activation's curved part and the result is O(1)."""
    d_out = d if d_out is None else d_out
    x = random_array(rng, (m, d), dtype)
    wg = (random_array(rng, (g, d, f), np.float32) / np.sqrt(d)).astype(dtype)
    wu = (random_array(rng, (g, d, f), np.float32) / np.sqrt(d)).astype(dtype)
    wd = (random_array(rng, (g, f, d_out), np.float32) / np.sqrt(f)).astype(dtype)
    return x, wg, wu, wd


def _grad_operands(rng, m, d, f, g, dtype):
    """dy [M, D], w_down [G, F, D], and pre [2, M, F] (gate, up) of the gradient kernel."""
    dy = random_array(rng, (m, d), dtype)
    wd = (random_array(rng, (g, f, d), np.float32) / np.sqrt(d)).astype(dtype)
    pre = (random_array(rng, (2, m, f), np.float32) * 2).astype(dtype)
    return dy, wd, pre


# ---------------------------------------------------------------- results and errors (CPU)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("m,d,f,g,pattern", [(40, 24, 16, 3, "ragged"), (7, 5, 3, 2, "short"),
                                             (64, 32, 48, 6, "empty_ends"),
                                             (20, 16, 8, 5, "ones")])
def test_matches_float64(rng, m, d, f, g, pattern, dtype, activation):
    x, wg, wu, wd = _operands(rng, m, d, f, g, dtype, d_out=d + 8)
    gs = group_sizes(pattern, m, g, rng)
    out = jax_tma.gated_ragged_mlp(x, wg, wu, wd, gs, activation)
    assert (out.shape, out.dtype) == ((m, d + 8), dtype)
    assert rel_error(out, f64_mlp(x, wg, wu, wd, gs, activation)) <= TOL[dtype]
    assert np.all(np.asarray(out, np.float32)[int(gs.sum()):] == 0)


def test_is_the_composition(rng):
    """The result is ragged_dot(gated_ragged_dot(...), w_down) bit for bit."""
    m, d, f, g = 33, 16, 24, 4
    x, wg, wu, wd = _operands(rng, m, d, f, g, BF16)
    gs = group_sizes("ragged", m, g, rng)
    out = jax_tma.gated_ragged_mlp(x, wg, wu, wd, gs, "gelu")
    want = jax_tma.ragged_dot(jax_tma.gated_ragged_dot(x, wg, wu, gs, "gelu"), wd, gs)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_float32_and_unfused_keywords(rng, exact_f32):
    m, d, f, g = 30, 16, 8, 3
    x, wg, wu, wd = _operands(rng, m, d, f, g, F32)
    gs = group_sizes("ragged", m, g, rng)
    out = jax_tma.gated_ragged_mlp(x, wg, wu, wd, gs)
    assert out.dtype == F32 and rel_error(out, f64_mlp(x, wg, wu, wd, gs, "silu")) <= 1e-5
    xb, wgb, wub, wdb = (a.astype(BF16) for a in (x, wg, wu, wd))
    out = jax_tma.gated_ragged_mlp(xb, wgb, wub, wdb, gs, preferred_element_type=jnp.float32)
    assert out.dtype == F32
    assert rel_error(out, f64_mlp(xb, wgb, wub, wdb, gs, "silu")) <= 1e-5


@pytest.mark.parametrize("shapes,message", [
    (((8, 4), (2, 4, 8), (2, 4, 8), (2, 8, 4), (3,)), r"group_sizes must be \[G\]"),
    (((8, 4), (2, 5, 8), (2, 5, 8), (2, 8, 4), (2,)), r"w_gate must be \[G, D, F\]"),
    (((8, 4), (2, 4, 8), (2, 4, 16), (2, 8, 4), (2,)), "w_gate and w_up must have one shape"),
    (((2, 8, 4), (2, 4, 8), (2, 4, 8), (2, 8, 4), (2,)), r"x must be \[M, D\]"),
    (((8, 4), (2, 4, 8), (2, 4, 8), (2, 4, 8), (2,)), r"w_down must be \[G, F, D'\].*\(2, 4, 8\)"),
    (((8, 4), (2, 4, 8), (2, 4, 8), (3, 8, 4), (2,)), r"w_down must be"),
])
def test_errors_name_the_shapes(shapes, message):
    args = [jnp.ones(s, BF16) for s in shapes[:4]] + [jnp.ones(shapes[4], jnp.int32)]
    with pytest.raises(ValueError, match=r"jax_tma\.gated_ragged_mlp: " + message):
        jax_tma.gated_ragged_mlp(*args)


def test_errors_activation_config_and_types():
    args = (jnp.ones((8, 8), BF16), jnp.ones((2, 8, 8), BF16), jnp.ones((2, 8, 8), BF16),
            jnp.ones((2, 8, 8), BF16))
    gs = jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="activation must be one of"):
        jax_tma.gated_ragged_mlp(*args, gs, "relu")
    with pytest.raises(ValueError, match="group_sizes must be integers"):
        jax_tma.gated_ragged_mlp(*args, jnp.array([4.0, 4.0]))
    with pytest.raises(ValueError, match=r"floating point, got \{'x': 'int32'\}"):
        jax_tma.gated_ragged_mlp(jnp.ones((8, 8), jnp.int32), *args[1:], gs)
    with pytest.raises(ValueError, match="not compiled for gated ragged products"):
        jax_tma.gated_ragged_mlp(*args, gs, config=jax_tma.GemmConfig(128, 256, 3, 2))
    out = jax_tma.gated_ragged_mlp(*args, gs, config=rd_config.GATED_RAGGED_CONFIGS[0])
    assert out.shape == (8, 8)


# ---------------------------------------------------------------- gradients (CPU)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_gradients_match_float64(rng, activation, dtype):
    m, d, f, g = 48, 16, 24, 4
    x, wg, wu, wd = _operands(rng, m, d, f, g, dtype, d_out=40)
    gs = group_sizes("short", m, g, rng)
    dy = random_array(rng, (m, 40), dtype)
    _, vjp = jax.vjp(lambda *a: jax_tma.gated_ragged_mlp(*a, gs, activation), x, wg, wu, wd)
    ours = vjp(jnp.asarray(dy))
    want = f64_mlp_vjp(x, wg, wu, wd, gs, dy, activation)
    for name, a, b in zip(("dx", "dwg", "dwu", "dwd"), ours, want):
        assert a.dtype == dtype, name
        assert rel_error(a, b) <= 2 * TOL[dtype], name
    assert np.all(np.asarray(ours[0], np.float32)[int(gs.sum()):] == 0)


def test_float32_gradients_match_float64(rng, exact_f32):
    m, d, f, g = 30, 12, 10, 3
    x, wg, wu, wd = _operands(rng, m, d, f, g, F32)
    gs = group_sizes("ragged", m, g, rng)
    dy = random_array(rng, (m, d), F32)
    _, vjp = jax.vjp(lambda *a: jax_tma.gated_ragged_mlp(*a, gs, "gelu_erf"), x, wg, wu, wd)
    for a, b in zip(vjp(jnp.asarray(dy)), f64_mlp_vjp(x, wg, wu, wd, gs, dy, "gelu_erf")):
        assert rel_error(a, b) <= 1e-5


def ggp_name(activation: str) -> str:
    return "gelu_tanh" if activation == "gelu" else activation


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_gradient_primitive_matches_float64(rng, dtype, activation):
    """The gradient primitive's XLA path (the kernel's reference): d_gate and d_up of dh = dy @
    w_down^T, rows past the last group zero."""
    m, d, f, g = 50, 24, 40, 4
    dy, wd, pre = _grad_operands(rng, m, d, f, g, dtype)
    gs = group_sizes("short", m, g, rng)
    d_gate, d_up = ggp.bind(jnp.asarray(dy)[None], jnp.asarray(wd)[None], jnp.asarray(gs)[None],
                            jnp.asarray(pre)[:, None], activation=ggp_name(activation),
                            out_dtype=dtype)
    want = f64_gate_up_grads(dy, wd, gs, pre[0], pre[1], activation)
    for a, b in zip((d_gate[0], d_up[0]), want):
        assert a.dtype == dtype and rel_error(a, b) <= GRAD_KERNEL_TOL[dtype]
        assert np.all(np.asarray(a, np.float32)[int(gs.sum()):] == 0)


def test_gradient_primitive_check_grads(rng, exact_f32):
    """The gradient primitive's JVP (and its transpose) against finite differences, forward and
    reverse mode to second order (float32)."""
    m, d, f, g = 10, 6, 5, 3
    dy, wd, pre = _grad_operands(rng, m, d, f, g, F32)
    gs = jnp.asarray(group_sizes("short", m, g, rng))[None]

    def fn(dy, wd, pre):
        d_gate, d_up = ggp.bind(dy[None], wd[None], gs, pre[:, None], activation="silu",
                                out_dtype=F32)
        return d_gate[0], d_up[0]

    check_grads(fn, (dy, wd, pre / 2), order=2, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)


def test_check_grads_order_2(rng, exact_f32):
    """Reverse mode against finite differences, to second order (float32): the second order
    goes through the gradient primitive's JVP and ragged_dot's transposes."""
    m, d, f, g = 12, 6, 5, 3
    x, wg, wu, wd = _operands(rng, m, d, f, g, F32)
    gs = jnp.asarray(group_sizes("short", m, g, rng))
    check_grads(lambda *a: jax_tma.gated_ragged_mlp(*a, gs), (x, wg, wu, wd), order=2,
                modes=("rev",), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- vmap and sharding (CPU)


def test_vmap_matches_a_loop(rng):
    v, m, d, f, g = 3, 20, 16, 8, 4
    x = random_array(rng, (v, m, d), BF16)
    _, wg, wu, wd = _operands(rng, m, d, f, g, BF16)
    gs = np.stack([group_sizes("ragged", m, g, rng) for _ in range(v)])
    out = jax.vmap(lambda x, gs: jax_tma.gated_ragged_mlp(x, wg, wu, wd, gs))(x, gs)
    for i in range(v):
        assert rel_error(out[i], f64_mlp(x[i], wg, wu, wd, gs[i], "silu")) <= TOL[BF16]
    # mapped weights too, and the gradients under vmap
    stack = lambda w: np.stack([w] * v)  # noqa: E731
    grads = jax.vmap(jax.grad(lambda x, a, b, c, s: jnp.sum(jax_tma.gated_ragged_mlp(
        x, a, b, c, s).astype(F32)), (0, 1, 2, 3)))(x, stack(wg), stack(wu), stack(wd), gs)
    for i in range(v):
        want = f64_mlp_vjp(x[i], wg, wu, wd, gs[i], np.ones((m, d)), "silu")
        for a, b in zip(grads, want):
            assert rel_error(a[i], b) <= 2 * TOL[BF16]


def test_gradient_primitive_vmap_is_one_primitive(rng):
    """vmap folds into the primitive's batch, the saved pre-activations' batch at dim 1."""
    v, m, d, f, g = 2, 16, 8, 16, 3
    dy = random_array(rng, (v, m, d), BF16)
    _, wd, pre = _grad_operands(rng, m, d, f, g, BF16)
    pres = np.stack([pre, pre[::-1]], axis=1)  # [2, V, M, F]
    gs = group_sizes("ragged", m, g, rng)

    def one(dy, pre):
        d_gate, d_up = ggp.bind(dy[None], jnp.asarray(wd)[None], jnp.asarray(gs)[None],
                                pre[:, None], activation="silu", out_dtype=BF16)
        return d_gate[0], d_up[0]

    fn = jax.vmap(one, in_axes=(0, 1))
    jaxpr = jax.make_jaxpr(fn)(dy, pres)
    eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive is ggp.gated_ragged_grad_p]
    assert len(eqns) == 1 and eqns[0].invars[3].aval.shape == (2, v, m, f)
    d_gate, d_up = fn(dy, pres)
    for i in range(v):
        want = f64_gate_up_grads(dy[i], wd, gs, pres[0, i], pres[1, i], "silu")
        assert rel_error(d_gate[i], want[0]) <= GRAD_KERNEL_TOL[BF16]
        assert rel_error(d_up[i], want[1]) <= GRAD_KERNEL_TOL[BF16]


@pytest.mark.parametrize("x_spec,w_spec,d_spec", [
    (P("x", None), P(), P()), (P(), P(None, None, "x"), P(None, "x", None)),
    (P("x", "y"), P(None, None, "y"), P(None, "y", None)), (P(None, "x"), P(None, "x", None), P())])
def test_sharded_matches_float64(rng, x_spec, w_spec, d_spec):
    """Tokens and F sharded run per device (local group sizes); a sharded D is gathered."""
    mesh = cpu_mesh((4, 2), ("x", "y"))
    m, d, f, g = 64, 16, 32, 5
    x, wg, wu, wd = _operands(rng, m, d, f, g, BF16)
    gs = group_sizes("ragged", m, g, rng)
    put = lambda a, s: jax.device_put(jnp.asarray(a), NamedSharding(mesh, s))  # noqa: E731
    xs, wgs, wus, wds = put(x, x_spec), put(wg, w_spec), put(wu, w_spec), put(wd, d_spec)
    out = jax.jit(jax_tma.gated_ragged_mlp)(xs, wgs, wus, wds, jnp.asarray(gs))
    assert rel_error(out, f64_mlp(x, wg, wu, wd, gs, "silu")) <= TOL[BF16]
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(jax_tma.gated_ragged_mlp(*a, gs).astype(F32)),
                             (0, 1, 2, 3)))(xs, wgs, wus, wds)
    for a, b in zip(grads, f64_mlp_vjp(x, wg, wu, wd, gs, np.ones((m, d)), "silu")):
        assert rel_error(a, b) <= 2 * TOL[BF16]


# ---------------------------------------------------------------- CUDA lowering (no GPU)


MLP_ARGS = (_spec((4096, 1024), BF16), _spec((8, 1024, 512), BF16), _spec((8, 1024, 512), BF16),
            _spec((8, 512, 1024), BF16))


def _loss(activation="silu"):
    gs = jnp.full(8, 512, jnp.int32)

    def loss(x, wg, wu, wd):
        return jnp.sum(jax_tma.gated_ragged_mlp(x, wg, wu, wd, gs, activation).astype(F32) ** 2)
    return loss


@needs_extension
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_cuda_lowering_backward_is_the_fused_gradient(activation):
    """Forward: the gated kernel (saving the pre-activations) and the down product; backward:
    the gated gradient kernel (d_gate and d_up from dy @ w_down^T's epilogue), ragged_dot's rows
    kernel for dx (against each of w_gate and w_up) and its contraction kernel for each of the
    three weights: no XLA product, no transpose."""
    hlo = cuda_hlo(jax.grad(_loss(activation), (0, 1, 2, 3)), *MLP_ARGS)
    assert target_calls(hlo, gp.KERNEL_TARGET) == 1
    assert target_calls(hlo, ggp.KERNEL_TARGET) == 1
    assert target_calls(hlo, RAGGED_TARGET) == 6
    assert "stablehlo.transpose" not in hlo


@needs_extension
def test_cuda_lowering_exact_gelu_and_float32_take_xla():
    """No gradient kernel for the exact GELU (its XLA reference runs), nor any kernel for fp32."""
    hlo = cuda_hlo(jax.grad(_loss("gelu_erf")), *MLP_ARGS)
    assert target_calls(hlo, ggp.KERNEL_TARGET) == 0 and target_calls(hlo, gp.KERNEL_TARGET) == 1
    f32 = tuple(_spec(a.shape, F32) for a in MLP_ARGS)
    hlo = cuda_hlo(jax.grad(_loss()), *f32)
    assert sum(target_calls(hlo, t) for t in (gp.KERNEL_TARGET, ggp.KERNEL_TARGET,
                                               RAGGED_TARGET)) == 0


@needs_extension
def test_cuda_lowering_vmap_is_one_kernel_each():
    args = (_spec((4, 512, 256), BF16),) + tuple(
        _spec(s, BF16) for s in ((8, 256, 128), (8, 256, 128), (8, 128, 256)))
    gs = jnp.full(8, 64, jnp.int32)
    fn = jax.vmap(jax.grad(lambda x, wg, wu, wd: jnp.sum(jax_tma.gated_ragged_mlp(
        x, wg, wu, wd, gs).astype(F32))), in_axes=(0, None, None, None))
    hlo = cuda_hlo(fn, *args)
    assert target_calls(hlo, ggp.KERNEL_TARGET) == 1
    assert target_calls(hlo, gp.KERNEL_TARGET) == 1


@needs_extension
def test_export_round_trip(rng):
    """The gradient exported for cpu and cuda (serialized and read back): the CUDA branch holds
    the kernels, the CPU branch computes the reference's values."""
    m, d, f, g = 48, 16, 24, 3
    x, wg, wu, wd = _operands(rng, m, d, f, g, BF16)
    gs = group_sizes("ragged", m, g, rng)

    def grad_x(x, wg, wu, wd, gs):
        return jax.grad(lambda x: jnp.sum(jax_tma.gated_ragged_mlp(x, wg, wu, wd, gs)
                                          .astype(F32)))(x)

    exported = jax.export.export(jax.jit(grad_x), platforms=("cpu", "cuda"),
                                 disabled_checks=jax_tma.export_disabled_checks())(
        _spec((m, d), BF16), _spec((g, d, f), BF16), _spec((g, d, f), BF16),
        _spec((g, f, d), BF16), _spec((g,), np.int32))
    exported = jax.export.deserialize(exported.serialize())
    assert exported.mlir_module().count(f"@{ggp.KERNEL_TARGET}(") == 1
    out = exported.call(jax.device_put(x, jax.devices("cpu")[0]), wg, wu, wd, gs)
    want = f64_mlp_vjp(x, wg, wu, wd, gs, np.ones((m, d)), "silu")[0]
    assert rel_error(out, want) <= 2 * TOL[BF16]


def test_export_cpu_round_trip(rng):
    """Without the extension too: exported for cpu, the primitives' local lowerings."""
    m, d, f, g = 24, 8, 16, 2
    x, wg, wu, wd = _operands(rng, m, d, f, g, BF16)
    gs = group_sizes("short", m, g, rng)
    exported = jax.export.export(jax.jit(jax_tma.gated_ragged_mlp), platforms=("cpu",))(
        _spec((m, d), BF16), _spec((g, d, f), BF16), _spec((g, d, f), BF16),
        _spec((g, f, d), BF16), _spec((g,), np.int32))
    cpu = jax.devices("cpu")[0]
    out = jax.export.deserialize(exported.serialize()).call(
        *(jax.device_put(a, cpu) for a in (x, wg, wu, wd, gs)))
    assert rel_error(out, f64_mlp(x, wg, wu, wd, gs, "silu")) <= TOL[BF16]


# ---------------------------------------------------------------- the kernel (Hopper GPU)


def _run_grad_kernel(dy, wd, gs, pre, activation, dtype, config):
    """The gradient kernel's (d_gate, d_up) over NaN-poisoned buffers, through the primitive's
    plan."""
    dy, wd, gs = (jnp.asarray(a)[None] for a in (dy, wd, gs))
    pre = jnp.asarray(pre)[:, None]
    plan = ggp.gated_grad_kernel_plan(dy, wd, gs, pre, activation, dtype)
    assert plan is not None
    fn = jax.jit(functools.partial(ggp._kernel_call, activation=activation, out_dtype=dtype,
                                   config=config, plan=plan, poison=True))
    outs = [np.asarray(o, np.float32)[0] for o in fn(dy, wd, gs, pre)]
    for o in outs:
        assert not np.isnan(o).any(), "kernel left poisoned (unwritten) outputs"
    return outs


CONFIG_IDS = ["x".join(map(str, c.tile)) for c in rd_config.GATED_RAGGED_GRAD_CONFIGS]


@pytest.mark.gpu
@pytest.mark.parametrize("config", rd_config.GATED_RAGGED_GRAD_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("activation", ggp.KERNEL_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_grad_kernel_matches_float64(rng, dtype, activation, config):
    m, d, f, g = 1000, 256, 320, 7
    dy, wd, pre = _grad_operands(rng, m, d, f, g, dtype)
    gs = group_sizes("ragged", m, g, rng)
    d_gate, d_up = _run_grad_kernel(dy, wd, gs, pre, activation, dtype, config)
    want = f64_gate_up_grads(dy, wd, gs, pre[0], pre[1], activation)
    assert rel_error(d_gate, want[0]) <= GRAD_KERNEL_TOL[dtype]
    assert rel_error(d_up, want[1]) <= GRAD_KERNEL_TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("config", rd_config.GATED_RAGGED_GRAD_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("pattern", ["short", "empty_ends", "ones"])
def test_grad_kernel_rows_past_the_groups_are_zero(rng, pattern, config):
    """Empty groups, one-row groups and sizes summing to less than M: both cotangents' rows past
    the last group are zero, none left unwritten; F not a multiple of the tile (a ragged last
    column block), D not a multiple of 64."""
    m, d, f, g = 777, 136, 200, 9
    dy, wd, pre = _grad_operands(rng, m, d, f, g, BF16)
    gs = group_sizes(pattern, m, g, rng)
    outs = _run_grad_kernel(dy, wd, gs, pre, "silu", BF16, config)
    want = f64_gate_up_grads(dy, wd, gs, pre[0], pre[1], "silu")
    end = int(gs.sum())
    for o, w in zip(outs, want):
        assert rel_error(o, w) <= GRAD_KERNEL_TOL[BF16]
        assert np.all(o[end:] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("m,d,f,g", [(1, 8, 8, 1), (5, 36, 20, 3), (300, 72, 1000, 2),
                                     (130, 64, 64, 130)])
def test_grad_kernel_edge_sizes_match_float64(rng, m, d, f, g):
    """One row, a few rows with D and F padded to multiples of 8, a wide F, and one-row
    groups (the last case: every group one row)."""
    dy, wd, pre = _grad_operands(rng, m, d, f, g, F16)
    gs = np.ones(g, np.int32) if g == m else (group_sizes("short", m, g, rng) if m > 1
                                              else np.array([1], np.int32))
    config = rd_config.GATED_RAGGED_GRAD_CONFIGS[0]
    d_gate, d_up = _run_grad_kernel(dy, wd, gs, pre, "gelu_tanh", F16, config)
    want = f64_gate_up_grads(dy, wd, gs, pre[0], pre[1], "gelu_tanh")
    assert rel_error(d_gate, want[0]) <= GRAD_KERNEL_TOL[F16]
    assert rel_error(d_up, want[1]) <= GRAD_KERNEL_TOL[F16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_kernel_step_matches_float64(rng, dtype):
    """The whole op on the GPU: result and every gradient, one compiled step with the gradient
    kernel in it."""
    m, d, f, g = 1024, 256, 192, 8
    x, wg, wu, wd = _operands(rng, m, d, f, g, dtype)
    gs = group_sizes("ragged", m, g, rng)
    dy = random_array(rng, (m, d), dtype)
    step = jax.jit(lambda *a: jax.vjp(lambda *w: jax_tma.gated_ragged_mlp(*w, gs), *a))
    compiled = jax.jit(lambda *a: step(*a)[1](jnp.asarray(dy))).lower(
        x, wg, wu, wd).compile().as_text()
    assert target_calls(compiled, ggp.KERNEL_TARGET) == 1
    out, vjp = step(x, wg, wu, wd)
    assert rel_error(out, f64_mlp(x, wg, wu, wd, gs, "silu")) <= TOL[dtype]
    for a, b in zip(jax.jit(vjp)(jnp.asarray(dy)), f64_mlp_vjp(x, wg, wu, wd, gs, dy, "silu")):
        assert rel_error(a, b) <= 2 * TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("config", rd_config.GATED_RAGGED_GRAD_CONFIGS, ids=CONFIG_IDS)
def test_grad_kernel_is_deterministic(rng, config):
    m, d, f, g = 2000, 512, 384, 16
    dy, wd, pre = _grad_operands(rng, m, d, f, g, BF16)
    gs = group_sizes("ragged", m, g, rng)
    first = _run_grad_kernel(dy, wd, gs, pre, "silu", BF16, config)
    for _ in range(3):
        again = _run_grad_kernel(dy, wd, gs, pre, "silu", BF16, config)
        for a, b in zip(again, first):
            np.testing.assert_array_equal(a, b)
