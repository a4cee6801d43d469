"""jax_tma.gated_ragged_dot: results and gradients against float64 references, errors, the
primitive's rules (vmap, sharding, export), the CUDA lowering, and the gated grouped kernel on a
Hopper GPU.

Error bounds (Frobenius-norm relative error against float64 on random data): bf16 1e-2, fp16
2e-3 for the result (its three roundings: each product, the activation, their product);
gradients 2x those (the cotangents round once more before the backward products). GPU tests
poison the outputs (NaN) so that any element the kernel does not write fails.
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
from jax_tma.ops.ragged import gated_primitive as gp
from support import (cpu_mesh, cuda_hlo, equations, f64_act, f64_act_grad, f64_ragged_contraction,
                     f64_ragged_rows, group_sizes, needs_extension, random_array, rel_error)

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
TOL = {BF16: 1e-2, F16: 2e-3, F32: 1e-5}
ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "gelu_erf"]


# ---------------------------------------------------------------- float64 references


def f64_gated(x, wg, wu, gs, activation):
    return f64_act(activation, f64_ragged_rows(x, wg, gs)) * f64_ragged_rows(x, wu, gs)


def f64_gated_vjp(x, wg, wu, gs, dy, activation):
    """(dx, dwg, dwu) of sum(dy * gated) in float64."""
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    g, u = f64_ragged_rows(x, wg, gs), f64_ragged_rows(x, wu, gs)
    dg, du = dy64 * u * f64_act_grad(activation, g), dy64 * f64_act(activation, g)
    dx = f64_ragged_rows(dg, np.swapaxes(np.asarray(wg, np.float64), 1, 2), gs) + f64_ragged_rows(
        du, np.swapaxes(np.asarray(wu, np.float64), 1, 2), gs)
    return dx, f64_ragged_contraction(x64, dg, gs), f64_ragged_contraction(x64, du, gs)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _operands(rng, m, k, f, g, dtype, scale=0.25):
    x = random_array(rng, (m, k), dtype)
    # Scaled so that the pre-activations spread over the activation's curved part.
    wg = (random_array(rng, (g, k, f), np.float32) * scale / np.sqrt(k) * 4).astype(dtype)
    wu = random_array(rng, (g, k, f), dtype)
    return x, wg, wu


# ---------------------------------------------------------------- results and errors (CPU)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("m,k,f,g,pattern", [(40, 24, 16, 3, "ragged"), (7, 5, 3, 2, "short"),
                                             (64, 32, 48, 6, "empty_ends")])
def test_matches_float64(rng, m, k, f, g, pattern, dtype, activation):
    x, wg, wu = _operands(rng, m, k, f, g, dtype)
    gs = group_sizes(pattern, m, g, rng)
    out = jax_tma.gated_ragged_dot(x, wg, wu, gs, activation)
    assert (out.shape, out.dtype) == ((m, f), dtype)
    assert rel_error(out, f64_gated(x, wg, wu, gs, activation)) <= TOL[dtype]
    assert np.all(np.asarray(out, np.float32)[int(gs.sum()):] == 0)


def test_float32_and_unfused_keywords(rng, exact_f32):
    m, k, f, g = 30, 16, 8, 3
    x, wg, wu = _operands(rng, m, k, f, g, F32)
    gs = group_sizes("ragged", m, g, rng)
    out = jax_tma.gated_ragged_dot(x, wg, wu, gs)
    assert out.dtype == F32 and rel_error(out, f64_gated(x, wg, wu, gs, "silu")) <= 1e-5
    xb, wgb, wub = (a.astype(BF16) for a in (x, wg, wu))
    out = jax_tma.gated_ragged_dot(xb, wgb, wub, gs, preferred_element_type=jnp.float32)
    assert out.dtype == F32
    assert rel_error(out, f64_gated(xb, wgb, wub, gs, "silu")) <= 1e-5


def test_matches_the_primitive_reference_bitwise(rng):
    """The public function's XLA path is the primitive's reference: its rounding points."""
    x, wg, wu = _operands(rng, 33, 16, 24, 4, BF16)
    gs = group_sizes("ragged", 33, 4, rng)
    out = jax_tma.gated_ragged_dot(x, wg, wu, gs, "gelu")
    ref, = gp._reference(jnp.asarray(x)[None], jnp.asarray(wg)[None], jnp.asarray(wu)[None],
                         jnp.asarray(gs)[None], activation="gelu_tanh", save_pre=False,
                         out_dtype=BF16, config=None, local=False)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref[0]))


@pytest.mark.parametrize("x_shape,w_shape,u_shape,gs_shape,message", [
    ((8, 4), (2, 4, 8), (2, 4, 8), (3,), "group_sizes must be"),
    ((8, 4), (2, 5, 8), (2, 5, 8), (2,), "w_gate must be"),
    ((8, 4), (2, 4, 8), (2, 4, 16), (2,), "one shape"),
    ((2, 8, 4), (2, 4, 8), (2, 4, 8), (2,), "x must be"),
    ((8, 4), (4, 8), (4, 8), (2,), "w_gate must be"),
])
def test_errors_name_the_shapes(x_shape, w_shape, u_shape, gs_shape, message):
    args = (jnp.ones(x_shape, BF16), jnp.ones(w_shape, BF16), jnp.ones(u_shape, BF16),
            jnp.ones(gs_shape, jnp.int32))
    with pytest.raises(ValueError, match=message):
        jax_tma.gated_ragged_dot(*args)


def test_errors_activation_config_and_group_size_type():
    args = (jnp.ones((8, 8), BF16), jnp.ones((2, 8, 8), BF16), jnp.ones((2, 8, 8), BF16))
    gs = jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="activation must be one of"):
        jax_tma.gated_ragged_dot(*args, gs, "relu")
    with pytest.raises(ValueError, match="integers"):
        jax_tma.gated_ragged_dot(*args, jnp.array([4.0, 4.0]))
    with pytest.raises(ValueError, match="not compiled for gated ragged products"):
        jax_tma.gated_ragged_dot(*args, gs, config=jax_tma.GemmConfig(128, 256, 3, 2))
    out = jax_tma.gated_ragged_dot(*args, gs, config=rd_config.GATED_RAGGED_CONFIGS[0])
    assert out.shape == (8, 8)


# ---------------------------------------------------------------- gradients (CPU)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bf16_gradients_match_float64(rng, activation):
    m, k, f, g = 48, 16, 24, 4
    x, wg, wu = _operands(rng, m, k, f, g, BF16)
    gs = group_sizes("short", m, g, rng)
    dy = random_array(rng, (m, f), BF16)
    _, vjp = jax.vjp(lambda *a: jax_tma.gated_ragged_dot(*a, gs, activation), x, wg, wu)
    ours = vjp(jnp.asarray(dy))
    for a, b in zip(ours, f64_gated_vjp(x, wg, wu, gs, dy, activation)):
        assert rel_error(a, b) <= 2 * TOL[BF16]


@pytest.mark.parametrize("activation", ["silu"])
def test_check_grads_order_2(rng, activation, exact_f32):
    """Forward and reverse mode against finite differences, to second order (float32); one
    activation (each one's first-order gradients are checked against float64 above)."""
    m, k, f, g = 12, 6, 5, 3
    x, wg, wu = _operands(rng, m, k, f, g, F32)
    gs = jnp.asarray(group_sizes("short", m, g, rng))
    check_grads(lambda *a: jax_tma.gated_ragged_dot(*a, gs, activation), (x, wg, wu), order=2,
                modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- vmap and sharding (CPU)


def test_vmap_matches_a_loop(rng):
    v, m, k, f, g = 3, 20, 16, 8, 4
    x = random_array(rng, (v, m, k), BF16)
    _, wg, wu = _operands(rng, m, k, f, g, BF16)
    gs = np.stack([group_sizes("ragged", m, g, rng) for _ in range(v)])
    out = jax.vmap(lambda x, gs: jax_tma.gated_ragged_dot(x, wg, wu, gs))(x, gs)
    for i in range(v):
        assert rel_error(out[i], f64_gated(x[i], wg, wu, gs[i], "silu")) <= TOL[BF16]
    # mapped weights too, and the gradient under vmap (the saved pre-activations batched)
    wgs, wus = np.stack([wg] * v), np.stack([wu] * v)
    grads = jax.vmap(jax.grad(lambda x, a, b, s: jnp.sum(jax_tma.gated_ragged_dot(
        x, a, b, s).astype(F32)), (0, 1)))(x, wgs, wus, gs)
    for i in range(v):
        want = f64_gated_vjp(x[i], wg, wu, gs[i], np.ones((m, f)), "silu")
        assert rel_error(grads[0][i], want[0]) <= 2 * TOL[BF16]
        assert rel_error(grads[1][i], want[1]) <= 2 * TOL[BF16]


def test_vmap_with_shared_weights_is_one_primitive_without_copies():
    x, w, gs = (_spec((4, 64, 32), BF16), _spec((8, 32, 16), BF16), _spec((8,), np.int32))
    jaxpr = jax.make_jaxpr(jax.vmap(jax_tma.gated_ragged_dot, in_axes=(0, None, None, None)))(
        x, w, w, gs)
    eqns = equations(jaxpr.jaxpr, gp.gated_ragged_dot_p)
    assert len(eqns) == 1
    assert eqns[0].invars[0].aval.shape == (4, 64, 32)
    assert eqns[0].invars[1].aval.shape == (1, 8, 32, 16)


@pytest.mark.parametrize("x_spec,w_spec", [(P("x", None), P()), (P(), P(None, None, "x")),
                                           (P("x", "y"), P(None, None, "y")),
                                           (P(None, "x"), P(None, "x", None))])
def test_sharded_matches_float64(rng, x_spec, w_spec):
    """Tokens and F sharded run per device (local group sizes); a sharded K is gathered."""
    mesh = cpu_mesh((4, 2), ("x", "y"))
    m, k, f, g = 64, 16, 32, 5
    x, wg, wu = _operands(rng, m, k, f, g, BF16)
    gs = group_sizes("ragged", m, g, rng)
    put = lambda a, s: jax.device_put(jnp.asarray(a), NamedSharding(mesh, s))  # noqa: E731
    xs, wgs, wus = put(x, x_spec), put(wg, w_spec), put(wu, w_spec)
    out = jax.jit(jax_tma.gated_ragged_dot)(xs, wgs, wus, jnp.asarray(gs))
    assert rel_error(out, f64_gated(x, wg, wu, gs, "silu")) <= TOL[BF16]
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(jax_tma.gated_ragged_dot(*a, gs).astype(F32)),
                             (0, 1, 2)))(xs, wgs, wus)
    for a, b in zip(grads, f64_gated_vjp(x, wg, wu, gs, np.ones((m, f)), "silu")):
        assert rel_error(a, b) <= 2 * TOL[BF16]


# ---------------------------------------------------------------- CUDA lowering (no GPU)


def _kernel_calls(hlo: str, target: str = gp.KERNEL_TARGET) -> int:
    return hlo.count(f"@{target}(") + hlo.count(f'"{target}"')


GATED_ARGS = (_spec((4096, 1024), BF16), _spec((8, 1024, 512), BF16),
              _spec((8, 1024, 512), BF16), _spec((8,), np.int32))


@needs_extension
def test_cuda_lowering_calls_the_kernel_once():
    assert _kernel_calls(cuda_hlo(jax_tma.gated_ragged_dot, *GATED_ARGS)) == 1
    f32 = tuple(_spec(a.shape, F32 if a.dtype == BF16 else a.dtype) for a in GATED_ARGS)
    assert _kernel_calls(cuda_hlo(jax_tma.gated_ragged_dot, *f32)) == 0


@needs_extension
def test_cuda_lowering_backward_is_ragged_kernels():
    """Forward: the gated kernel (saving the pre-activations); backward: ragged_dot's rows
    kernel for dx (twice: against each weight) and its contraction kernel for each weight."""
    gs = jnp.full(8, 512, jnp.int32)

    def loss(x, wg, wu):
        return jnp.sum(jax_tma.gated_ragged_dot(x, wg, wu, gs).astype(F32))

    hlo = cuda_hlo(jax.grad(loss, (0, 1, 2)), *GATED_ARGS[:3])
    assert _kernel_calls(hlo) == 1
    assert _kernel_calls(hlo, "jax_tma_ragged_dot_sm90") == 4
    assert "stablehlo.transpose" not in hlo


@needs_extension
def test_cuda_lowering_vmap_is_one_kernel():
    args = (_spec((4, 512, 256), BF16), _spec((8, 256, 128), BF16), _spec((8, 256, 128), BF16),
            _spec((8,), np.int32))
    hlo = cuda_hlo(jax.vmap(jax_tma.gated_ragged_dot, in_axes=(0, None, None, None)), *args)
    assert _kernel_calls(hlo) == 1


@needs_extension
def test_export_round_trip(rng):
    """Exported for cpu and cuda (serialized and read back): the CUDA branch holds the kernel,
    the CPU branch computes the reference's values."""
    m, k, f, g = 48, 16, 24, 3
    x, wg, wu = _operands(rng, m, k, f, g, BF16)
    gs = group_sizes("ragged", m, g, rng)
    exported = jax.export.export(jax.jit(jax_tma.gated_ragged_dot), platforms=("cpu", "cuda"),
                                 disabled_checks=jax_tma.export_disabled_checks())(
        _spec((m, k), BF16), _spec((g, k, f), BF16), _spec((g, k, f), BF16),
        _spec((g,), np.int32))
    exported = jax.export.deserialize(exported.serialize())
    assert exported.mlir_module().count(f"@{gp.KERNEL_TARGET}(") == 1
    out = exported.call(jax.device_put(x, jax.devices("cpu")[0]), wg, wu, gs)
    assert rel_error(out, f64_gated(x, wg, wu, gs, "silu")) <= TOL[BF16]


def test_export_cpu_round_trip(rng):
    """Without the extension too: exported for cpu, the primitive's local lowering."""
    m, k, f, g = 24, 8, 16, 2
    x, wg, wu = _operands(rng, m, k, f, g, BF16)
    gs = group_sizes("short", m, g, rng)
    exported = jax.export.export(jax.jit(jax_tma.gated_ragged_dot), platforms=("cpu",))(
        _spec((m, k), BF16), _spec((g, k, f), BF16), _spec((g, k, f), BF16),
        _spec((g,), np.int32))
    cpu = jax.devices("cpu")[0]
    out = jax.export.deserialize(exported.serialize()).call(
        *(jax.device_put(a, cpu) for a in (x, wg, wu, gs)))
    assert rel_error(out, f64_gated(x, wg, wu, gs, "silu")) <= TOL[BF16]


# ---------------------------------------------------------------- the kernel (Hopper GPU)


def _run_kernel(x, wg, wu, gs, activation, dtype, config, save_pre=True):
    """The kernel's results over NaN-poisoned buffers, through the primitive's plan."""
    x, wg, wu, gs = (jnp.asarray(a)[None] for a in (x, wg, wu, gs))
    plan = gp.gated_kernel_plan(x, wg, wu, gs, dtype)
    assert plan is not None
    fn = jax.jit(functools.partial(gp._kernel_call, activation=activation, save_pre=save_pre,
                                   out_dtype=dtype, config=config, plan=plan, poison=True))
    outs = [np.asarray(o, np.float32) for o in fn(x, wg, wu, gs)]
    for o in outs:
        assert not np.isnan(o).any(), "kernel left poisoned (unwritten) outputs"
    return outs


CONFIG_IDS = ["x".join(map(str, c.tile)) for c in rd_config.GATED_RAGGED_CONFIGS]


@pytest.mark.gpu
@pytest.mark.parametrize("config", rd_config.GATED_RAGGED_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu_erf"])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_kernel_matches_float64(rng, dtype, activation, config):
    m, k, f, g = 1000, 256, 320, 7
    x, wg, wu = _operands(rng, m, k, f, g, dtype)
    gs = group_sizes("ragged", m, g, rng)
    out, pre = _run_kernel(x, wg, wu, gs, activation, dtype, config)
    out, pre = out[0], pre[:, 0]
    assert rel_error(out, f64_gated(x, wg, wu, gs, activation)) <= TOL[dtype]
    assert rel_error(pre[0], f64_ragged_rows(x, wg, gs)) <= TOL[dtype]
    assert rel_error(pre[1], f64_ragged_rows(x, wu, gs)) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("config", rd_config.GATED_RAGGED_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("pattern", ["short", "empty_ends"])
@pytest.mark.parametrize("save_pre", [True, False])
def test_kernel_rows_past_the_groups_are_zero(rng, pattern, config, save_pre):
    """Empty groups, and sizes summing to less than M: every result's rows past the last group
    are zero (the pre-activations too), none left unwritten."""
    m, k, f, g = 777, 136, 200, 9  # F not a multiple of the tile: a ragged last column block
    x, wg, wu = _operands(rng, m, k, f, g, BF16)
    gs = group_sizes(pattern, m, g, rng)
    outs = _run_kernel(x, wg, wu, gs, "silu", BF16, config, save_pre)
    assert rel_error(outs[0][0], f64_gated(x, wg, wu, gs, "silu")) <= TOL[BF16]
    end = int(gs.sum())
    assert np.all(outs[0][0, end:] == 0)
    if save_pre:
        assert np.all(outs[1][:, 0, end:] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,f,g", [(1, 8, 8, 1), (5, 40, 24, 3), (300, 72, 1000, 2)])
def test_kernel_edge_sizes_match_float64(rng, m, k, f, g):
    x, wg, wu = _operands(rng, m, k, f, g, F16)
    gs = group_sizes("short", m, g, rng) if m > 1 else np.array([1], np.int32)
    out = jax_tma.gated_ragged_dot(x, wg, wu, gs, "gelu")
    assert rel_error(out, f64_gated(x, wg, wu, gs, "gelu")) <= TOL[F16]


@pytest.mark.gpu
def test_kernel_grads_match_float64(rng):
    m, k, f, g = 1024, 256, 192, 8
    x, wg, wu = _operands(rng, m, k, f, g, BF16)
    gs = group_sizes("ragged", m, g, rng)
    dy = random_array(rng, (m, f), BF16)
    _, vjp = jax.vjp(lambda *a: jax_tma.gated_ragged_dot(*a, gs), x, wg, wu)
    for a, b in zip(jax.jit(vjp)(jnp.asarray(dy)), f64_gated_vjp(x, wg, wu, gs, dy, "silu")):
        assert rel_error(a, b) <= 2 * TOL[BF16]


@pytest.mark.gpu
@pytest.mark.parametrize("config", rd_config.GATED_RAGGED_CONFIGS, ids=CONFIG_IDS)
def test_kernel_is_deterministic(rng, config):
    m, k, f, g = 2000, 512, 384, 16
    x, wg, wu = _operands(rng, m, k, f, g, BF16)
    gs = jnp.asarray(group_sizes("ragged", m, g, rng))
    fn = jax.jit(functools.partial(jax_tma.gated_ragged_dot, config=config))
    first = np.asarray(fn(x, wg, wu, gs))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(fn(x, wg, wu, gs)), first)
