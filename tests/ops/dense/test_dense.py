"""jax_tma.dense / gated_dense / mlp / gated_mlp: fused epilogues against float64 references, their
gradients, vmap, sharding, the CUDA lowering, and the fused kernels on a Hopper GPU.

The fused kernel applies the epilogue in fp32 and rounds where the unfused 16-bit expression
rounds; the references are float64 of the same math, unrounded. Bounds (Frobenius-norm relative
error): bf16 output 1e-2, fp16 2e-3; gradients twice that (two roundings: the saved
pre-activation and the cotangent).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jax import lax
from jax.test_util import check_grads

import jax_tma
from jax_tma.ops.dense import api as ep_api
from jax_tma.ops.dense import config as ep_config
from jax_tma.ops.dense import primitive as ep
from support import (cpu_mesh, cuda_hlo, f64_act, f64_act_grad, needs_extension, random_array,
                     rel_error)

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
TOL = {BF16: 1e-2, F16: 2e-3, F32: 1e-5}
ACTIVATIONS = [None, "relu", "gelu", "gelu_erf", "silu"]


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "gelu_erf", "silu"])
def test_reference_activation_grads_match_finite_differences(activation):
    """The float64 derivatives (support.f64_act_grad) against central differences of f64_act
    (step 1e-5: error ~1e-10), away from relu's kink."""
    z = np.concatenate([np.linspace(-8, 8, 1601), [-30.0, -0.3, 0.3, 30.0]])
    z = z[np.abs(z) > 1e-3]
    h = 1e-5
    numeric = (f64_act(activation, z + h) - f64_act(activation, z - h)) / (2 * h)
    np.testing.assert_allclose(f64_act_grad(activation, z), numeric, rtol=1e-7, atol=1e-8)


def f64_dense(x, w, bias=None, activation=None, residual=None):
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if bias is not None:
        z = z + np.asarray(bias, np.float64)
    y = f64_act(activation, z)
    return y + np.asarray(residual, np.float64) if residual is not None else y


def f64_gated(x, wg, wu, activation):
    x64 = np.asarray(x, np.float64)
    return f64_act(activation, x64 @ np.asarray(wg, np.float64)) * (x64 @ np.asarray(wu, np.float64))


def _operands(rng, m, k, n, dtype):
    x = random_array(rng, (m, k), dtype)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    return x, w


# ---------------------------------------------------------------- semantics (CPU)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias,with_residual", [(True, True), (False, False), (True, False)])
def test_dense_matches_float64(rng, activation, with_bias, with_residual):
    x, w = _operands(rng, 24, 16, 40, BF16)
    bias = rng.standard_normal(40).astype(BF16) if with_bias else None
    residual = random_array(rng, (24, 40), BF16) if with_residual else None
    out = jax_tma.dense(x, w, bias, activation, residual)
    assert out.dtype == BF16 and out.shape == (24, 40)
    assert rel_error(out, f64_dense(x, w, bias, activation, residual)) <= TOL[BF16]


def test_dense_result_type_follows_promotion(rng):
    x, w = _operands(rng, 8, 8, 8, BF16)
    assert jax_tma.dense(x, w, np.zeros(8, np.float32)).dtype == F32  # as x @ w + b in jnp
    assert jax_tma.dense(x.astype(F16), w.astype(F16)).dtype == F16


def test_dense_leading_dims_and_errors(rng):
    x = random_array(rng, (2, 3, 16), BF16)
    w = (rng.standard_normal((16, 8)) / 4).astype(BF16)
    out = jax_tma.dense(x, w, activation="relu")
    assert out.shape == (2, 3, 8)
    assert rel_error(out, f64_dense(x.reshape(6, 16), w, activation="relu").reshape(2, 3, 8)) <= TOL[BF16]
    with pytest.raises(ValueError, match="activation must be one of"):
        jax_tma.dense(x, w, activation="tanh")
    with pytest.raises(ValueError, match=r"w must be \[K, N\]"):
        jax_tma.dense(x, w.T)
    with pytest.raises(ValueError, match="bias must be"):
        jax_tma.dense(x, w, bias=np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="residual must have"):
        jax_tma.dense(x, w, residual=np.zeros((6, 8), BF16))
    with pytest.raises(ValueError, match="not compiled for the forward fusion"):
        jax_tma.dense(x, w, activation="gelu_erf", config=jax_tma.GemmConfig(128, 256, 3, 2))


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_erf"])
def test_gated_matches_float64(rng, activation):
    x, wg = _operands(rng, 20, 24, 32, BF16)
    wu = (rng.standard_normal((24, 32)) / 5).astype(BF16)
    out = jax_tma.gated_dense(x, wg, wu, activation)
    assert rel_error(out, f64_gated(x, wg, wu, activation)) <= TOL[BF16]
    with pytest.raises(ValueError, match="one shape"):
        jax_tma.gated_dense(x, wg, wu[:, :16])


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", None])
def test_mlp_matches_float64(rng, activation):
    x, w1 = _operands(rng, 24, 16, 48, BF16)
    w2 = (rng.standard_normal((48, 16)) / 7).astype(BF16)
    b1, b2 = rng.standard_normal(48).astype(F32), rng.standard_normal(16).astype(F32)
    out = jax_tma.mlp(x, w1, b1, w2, b2, activation, residual=x)
    h = np.asarray(jnp.asarray(f64_dense(x, w1, b1, activation), BF16), np.float64)
    assert rel_error(out, f64_dense(h, w2, b2, residual=x)) <= 2 * TOL[BF16]


def f64_gated_grads(dy, wd, gate, up, activation):
    """The gated product's gate and up cotangents from the down projection's cotangent dy:
    (dy @ wd^T * up * act'(gate), dy @ wd^T * act(gate)), float64."""
    h = np.asarray(dy, np.float64) @ np.asarray(wd, np.float64).T
    gate64 = np.asarray(gate, np.float64)
    slope = f64_act_grad(activation, gate64)
    return h * np.asarray(up, np.float64) * slope, h * f64_act(activation, gate64)


def test_gated_mlp_matches_float64(rng):
    x, wg = _operands(rng, 20, 24, 32, BF16)
    wu = (rng.standard_normal((24, 32)) / 5).astype(BF16)
    wd = (rng.standard_normal((32, 24)) / 6).astype(BF16)
    out = jax_tma.gated_mlp(x.reshape(4, 5, 24), wg, wu, wd, "silu", residual=x.reshape(4, 5, 24))
    h = np.asarray(jnp.asarray(f64_gated(x, wg, wu, "silu"), BF16), np.float64)
    want = h @ np.asarray(wd, np.float64) + np.asarray(x, np.float64)
    assert out.shape == (4, 5, 24)
    assert rel_error(out.reshape(20, 24), want) <= 2 * TOL[BF16]
    with pytest.raises(ValueError, match="w_down must be"):
        jax_tma.gated_mlp(x, wg, wu, wd[:16])
    with pytest.raises(ValueError, match="residual must have shape"):
        jax_tma.gated_mlp(x, wg, wu, wd, residual=x[:4])
    with pytest.raises(ValueError, match="activation must be one of"):
        jax_tma.gated_mlp(x, wg, wu, wd, "relu")


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_erf"])
def test_gated_mlp_bf16_gradients_match_float64(rng, activation):
    x, wg = _operands(rng, 32, 16, 40, BF16)
    wu = (rng.standard_normal((16, 40)) / 4).astype(BF16)
    wd = (rng.standard_normal((40, 16)) / 6).astype(BF16)
    dy = random_array(rng, (32, 16), BF16)
    _, vjp = jax.vjp(lambda x, a, b, c: jax_tma.gated_mlp(x, a, b, c, activation), x, wg, wu, wd)
    dx, dwg, dwu, dwd = vjp(jnp.asarray(dy))
    x64 = np.asarray(x, np.float64)
    gate, up = x64 @ np.asarray(wg, np.float64), x64 @ np.asarray(wu, np.float64)
    d_gate, d_up = f64_gated_grads(dy, wd, gate, up, ep_api._canonical(activation, ep.GATED_ACTIVATIONS, ""))
    h = f64_act(ep_api._canonical(activation, ep.GATED_ACTIVATIONS, ""), gate) * up
    assert rel_error(dwd, h.T @ np.asarray(dy, np.float64)) <= 2 * TOL[BF16]
    assert rel_error(dwg, x64.T @ d_gate) <= 2 * TOL[BF16]
    assert rel_error(dwu, x64.T @ d_up) <= 2 * TOL[BF16]
    want_dx = d_gate @ np.asarray(wg, np.float64).T + d_up @ np.asarray(wu, np.float64).T
    assert rel_error(dx, want_dx) <= 2 * TOL[BF16]


# ---------------------------------------------------------------- gradients, vmap (CPU)


@pytest.mark.parametrize("activation", ["gelu", "silu", "gelu_erf", None])
def test_dense_check_grads(rng, activation, exact_f32):
    x, w = _operands(rng, 6, 8, 8, F32)
    b, r = rng.standard_normal(8).astype(F32), random_array(rng, (6, 8), F32)
    f = lambda x, w, b, r: jax_tma.dense(x, w, b, activation, r)  # noqa: E731
    check_grads(f, (x, w, b, r), order=2, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2)


def test_relu_check_grads_order_1(rng, exact_f32):
    x, w = _operands(rng, 6, 8, 8, F32)
    check_grads(lambda x, w: jax_tma.dense(x, w, activation="relu"), (x, w), order=1,
                modes=("fwd", "rev"), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_and_mlp_check_grads(rng, activation, exact_f32):
    x, wg = _operands(rng, 6, 8, 8, F32)
    wu = rng.standard_normal((8, 8)).astype(F32) / 3
    check_grads(lambda x, a, b: jax_tma.gated_dense(x, a, b, activation), (x, wg, wu), order=2,
                modes=("fwd", "rev"), atol=1e-2, rtol=1e-2)
    # mlp is a custom_vjp (its backward fuses across the two layers): reverse mode only.
    b1, b2 = rng.standard_normal(8).astype(F32), rng.standard_normal(8).astype(F32)
    check_grads(lambda x, a, b1, b, b2: jax_tma.mlp(x, a, b1, b, b2, activation, x),
                (x, wg, b1, wu, b2), order=2, modes=("rev",), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_mlp_check_grads(rng, activation, exact_f32):
    # A custom_vjp (its backward fuses the gated gradient into a product): reverse mode only,
    # second order through the gated-gradient product's own backward.
    x, wg = _operands(rng, 6, 8, 8, F32)
    wu = rng.standard_normal((8, 8)).astype(F32) / 3
    wd = rng.standard_normal((8, 8)).astype(F32) / 3
    check_grads(lambda x, a, b, c: jax_tma.gated_mlp(x, a, b, c, activation, x),
                (x, wg, wu, wd), order=2, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_bf16_gradients_match_float64(rng):
    x, w = _operands(rng, 32, 16, 24, BF16)
    b = rng.standard_normal(24).astype(BF16)
    dy = random_array(rng, (32, 24), BF16)
    _, vjp = jax.vjp(lambda x, w, b: jax_tma.dense(x, w, b, "gelu"), x, w, b)
    dx, dw, db = vjp(jnp.asarray(dy))
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
    dz = np.asarray(dy, np.float64) * f64_act_grad("gelu_tanh", z)
    assert rel_error(dx, dz @ np.asarray(w, np.float64).T) <= 2 * TOL[BF16]
    assert rel_error(dw, np.asarray(x, np.float64).T @ dz) <= 2 * TOL[BF16]
    assert rel_error(db, dz.sum(0)) <= 2 * TOL[BF16]


def test_vmap_matches_unbatched(rng):
    x = random_array(rng, (3, 10, 16), BF16)
    w = (rng.standard_normal((16, 8)) / 4).astype(BF16)
    out = jax.vmap(lambda x: jax_tma.dense(x, w, activation="silu"))(x)
    for i in range(3):
        assert rel_error(out[i], f64_dense(x[i], w, activation="silu")) <= TOL[BF16]
    ws = np.stack([w, w * 2])
    out = jax.vmap(lambda w: jax_tma.dense(x[0], w, activation="relu"))(ws)  # mapped weights
    assert rel_error(out[1], f64_dense(x[0], ws[1], activation="relu")) <= TOL[BF16]


def test_vmap_of_the_gated_gradient(rng):
    # The gated-gradient primitive batched: its [2, M, N] pre-activations carry the batch in
    # dim 1 once folded.
    x = random_array(rng, (3, 8, 16), BF16)
    wg, wu = ((rng.standard_normal((16, 24)) / 4).astype(BF16) for _ in range(2))
    wd = (rng.standard_normal((24, 16)) / 5).astype(BF16)

    def loss(x):
        return jnp.sum(jax_tma.gated_mlp(x, wg, wu, wd).astype(F32) ** 2)

    got = jax.vmap(jax.grad(loss))(x)
    for i in range(3):
        assert rel_error(got[i], jax.grad(loss)(x[i])) <= TOL[BF16]
    pre = jnp.asarray(random_array(rng, (3, 2, 8, 24), BF16))
    dy = jnp.asarray(random_array(rng, (3, 8, 16), BF16))
    dg, du = jax.vmap(lambda g, p: ep_api._gated_grad_product(g, wd, p, "silu", None))(dy, pre)
    for i in range(3):
        want = f64_gated_grads(dy[i], wd, pre[i, 0], pre[i, 1], "silu")
        assert rel_error(dg[i], want[0]) <= TOL[BF16]
        assert rel_error(du[i], want[1]) <= TOL[BF16]


# ---------------------------------------------------------------- sharding (8 CPU devices)


@pytest.mark.parametrize("x_spec,w_spec", [(P("x", None), P()), (P(), P(None, "x")),
                                           (P("x", "y"), P("y", None)), (P("x", None), P(None, "y"))])
def test_sharded_matches_unsharded(rng, x_spec, w_spec):
    mesh = cpu_mesh((4, 2), ("x", "y"))
    x, w = _operands(rng, 32, 16, 24, BF16)
    b = rng.standard_normal(24).astype(BF16)
    xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, x_spec))
    ws = jax.device_put(jnp.asarray(w), NamedSharding(mesh, w_spec))
    out = jax.jit(lambda x, w: jax_tma.dense(x, w, b, "gelu", x @ w))(xs, ws)
    assert rel_error(out, f64_dense(x, w, b, "gelu", np.asarray(jnp.asarray(x) @ jnp.asarray(w)))) <= TOL[BF16]
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(jax_tma.dense(x, w, b, "gelu").astype(F32) ** 2),
                             (0, 1)))(xs, ws)
    ref = jax.grad(lambda x, w: jnp.sum(jax_tma.dense(x, w, b, "gelu").astype(F32) ** 2), (0, 1))(
        jnp.asarray(x), jnp.asarray(w))
    for a, r in zip(grads, ref):
        assert rel_error(a, r) <= 2 * TOL[BF16]


@pytest.mark.parametrize("x_spec,f_axis", [(P("x", None), None), (P(), "y"), (P("x", None), "y")])
def test_sharded_gated_mlp_gradients(rng, x_spec, f_axis):
    mesh = cpu_mesh((4, 2), ("x", "y"))
    x, wg = _operands(rng, 32, 16, 48, BF16)
    wu = (rng.standard_normal((16, 48)) / 4).astype(BF16)
    wd = (rng.standard_normal((48, 16)) / 7).astype(BF16)
    put = lambda v, spec: jax.device_put(jnp.asarray(v), NamedSharding(mesh, spec))  # noqa: E731
    w_spec, down_spec = P(None, f_axis), P(f_axis, None)  # F sharded alike in all three

    def loss(x, a, b, c):
        return jnp.sum(jax_tma.gated_mlp(x, a, b, c, "silu", x).astype(F32) ** 2)

    got = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(put(x, x_spec), put(wg, w_spec), put(wu, w_spec),
                                                put(wd, down_spec))
    want = jax.grad(loss, (0, 1, 2, 3))(*(jnp.asarray(v) for v in (x, wg, wu, wd)))
    for a, b in zip(got, want):
        assert rel_error(a, b) <= 2 * TOL[BF16]


# ---------------------------------------------------------------- CUDA lowering (no GPU)


def _calls(hlo: str) -> dict:
    found = re.findall(r"@(jax_tma_\w+)\(", hlo) + re.findall(r'custom_call_target="(jax_tma_\w+)"', hlo)
    return {name: found.count(name) for name in set(found)}


def _spec(shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


@needs_extension
@pytest.mark.smoke
def test_cuda_lowering_is_one_fused_kernel():
    x, w, b = _spec((4096, 1024)), _spec((1024, 2048)), _spec((2048,))
    r = _spec((4096, 2048))
    assert _calls(cuda_hlo(lambda x, w, b, r: jax_tma.dense(x, w, b, "gelu", r), x, w, b, r)) == {
        ep.KERNEL_TARGET: 1}
    assert _calls(cuda_hlo(lambda x, w, u: jax_tma.gated_dense(x, w, u), x, w, w)) == {
        ep.KERNEL_TARGET: 1}


@needs_extension
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_cuda_lowering_reads_a_16bit_bias_as_it_is(dtype):
    # The epilogue widens a bf16/fp16 bias itself: no conversion pass before the kernel.
    x, w, b = _spec((4096, 1024), dtype), _spec((1024, 2048), dtype), _spec((2048,), dtype)
    hlo = cuda_hlo(lambda x, w, b: jax_tma.dense(x, w, b, "gelu"), x, w, b)
    assert _calls(hlo) == {ep.KERNEL_TARGET: 1}
    assert "stablehlo.convert" not in hlo
    hlo = cuda_hlo(lambda x, w, b: jax_tma.mlp(x, w, b, w.T, b[:1024], "gelu"), x, w, b)
    assert "stablehlo.convert" not in hlo


@needs_extension
@pytest.mark.smoke
def test_cuda_lowering_of_the_gradients():
    x, w1, w2 = _spec((4096, 1024)), _spec((1024, 2048)), _spec((2048, 1024))
    hlo = cuda_hlo(jax.grad(lambda x, w: jnp.sum(jax_tma.dense(x, w, activation="gelu")), (0, 1)),
                   x, w1)
    assert _calls(hlo) == {ep.KERNEL_TARGET: 1, "jax_tma_gemm_sm90": 2}
    # mlp backward: the act-grad product is fused; the second forward product is not needed.
    hlo = cuda_hlo(jax.grad(lambda x, a, b: jnp.sum(jax_tma.mlp(x, a, None, b, None, "gelu")),
                            (0, 1, 2)), x, w1, w2)
    assert _calls(hlo) == {ep.KERNEL_TARGET: 2, "jax_tma_gemm_sm90": 3}
    assert "stablehlo.transpose" not in hlo
    # gated_mlp backward: one fused product writes both cotangents; no elementwise pass over
    # them (the forward's gated kernel, the gated gradient and five products; the down
    # projection's forward is not needed).
    hlo = cuda_hlo(jax.grad(lambda x, a, b, c: jnp.sum(jax_tma.gated_mlp(x, a, b, c)),
                            (0, 1, 2, 3)), x, w1, w1, w2)
    assert _calls(hlo) == {ep.KERNEL_TARGET: 2, "jax_tma_gemm_sm90": 5}
    assert "stablehlo.transpose" not in hlo
    assert "stablehlo.logistic" not in hlo and "stablehlo.exponential" not in hlo
    # Fewer rows than GATED_GRADIENT_MIN_ROWS: XLA's dot and elementwise pass instead.
    rows = ep_config.GATED_GRADIENT_MIN_ROWS - 64
    hlo = cuda_hlo(jax.grad(lambda x, a, b, c: jnp.sum(jax_tma.gated_mlp(x, a, b, c)),
                            (0, 1, 2, 3)), _spec((rows, 1024)), w1, w1, w2)
    assert _calls(hlo).get(ep.KERNEL_TARGET) == 1  # the gated forward only
    assert "stablehlo.dot_general" in hlo


# ---------------------------------------------------------------- the fused kernels (GPU)


def _poisoned(a, b, *rest, **params):
    """The kernel's outputs, each written over a NaN-poisoned buffer."""
    params = dict(dict(activation=None, has_bias=False, has_aux=False, save_pre=False,
                       b_k_major=False, config=None), **params)
    assert ep.kernel_applies(a, b, rest, kind=params["kind"], activation=params["activation"],
                             has_bias=params["has_bias"], has_aux=params["has_aux"],
                             b_k_major=params["b_k_major"], out_dtype=params["out_dtype"])
    fn = jax.jit(functools.partial(ep._kernel_call, poison=True, **params))
    outs = [np.asarray(o, np.float64) for o in fn(a, b, *rest)]
    for i, out in enumerate(outs):
        assert not np.isnan(out).any(), f"kernel left poisoned (unwritten) values in output {i}"
    return outs


def _config_ids(configs):
    return ["x".join(map(str, c.tile)) + ("sk" if c.stream_k else "") for c in configs]


FORWARD_CONFIGS = [*ep_config.DENSE_CONFIGS, jax_tma.GemmConfig(128, 256, 3, 1, stream_k=True)]


# Every compiled (tile, activation) of the forward fusion: gelu_erf on the narrow tiles only.
FORWARD_CASES = [(act, cfg) for act in ACTIVATIONS for cfg in FORWARD_CONFIGS
                 if act != "gelu_erf" or cfg.tile in ep_config._NARROW_TILES]


@pytest.mark.gpu
@pytest.mark.parametrize("activation,config", FORWARD_CASES,
                         ids=[f"{a}-{i}" for (a, _), i in
                              zip(FORWARD_CASES, _config_ids([c for _, c in FORWARD_CASES]))])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_kernel_forward_matches_float64(rng, dtype, activation, config):
    m, k, n = (1000, 512, 776) if dtype == BF16 else (300, 1088, 264)
    x, w = _operands(rng, m, k, n, dtype)
    bias = rng.standard_normal(n).astype(F32)
    residual = random_array(rng, (m, n), dtype)
    act = "gelu_tanh" if activation == "gelu" else activation
    out, pre = _poisoned(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), jnp.asarray(residual),
                         kind=ep_config.FORWARD, activation=act, has_bias=True, has_aux=True,
                         save_pre=True, out_dtype=dtype, config=config)
    assert rel_error(out, f64_dense(x, w, bias, act, residual)) <= TOL[dtype]
    assert rel_error(pre, f64_dense(x, w, bias)) <= TOL[dtype]
    plain, = _poisoned(jnp.asarray(x), jnp.asarray(w), kind=ep_config.FORWARD, activation=act,
                       out_dtype=dtype, config=config)
    assert rel_error(plain, f64_dense(x, w, activation=act)) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("bias_dtype", [BF16, F16, F32])
def test_kernel_reads_each_bias_type(rng, bias_dtype):
    # fp32, bf16 and fp16 biases are read as they are and widened in the epilogue; the tile's
    # last columns past N (776 = 3 x 256 + 8) get none.
    m, k, n = 520, 256, 776
    dtype = F16 if bias_dtype == F16 else BF16
    x, w = _operands(rng, m, k, n, dtype)
    bias = (4 * rng.standard_normal(n)).astype(bias_dtype)
    out, = _poisoned(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), kind=ep_config.FORWARD,
                     activation="gelu_tanh", has_bias=True, out_dtype=dtype)
    assert rel_error(out, f64_dense(x, w, bias, "gelu_tanh")) <= TOL[dtype]
    # The public op with the bias in the operands' type, and its gradients.
    got = jax_tma.dense(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias.astype(dtype)), "gelu")
    assert rel_error(got, f64_dense(x, w, bias.astype(dtype), "gelu")) <= TOL[dtype]
    db = jax.grad(lambda b: jnp.sum(jax_tma.dense(jnp.asarray(x), jnp.asarray(w), b, "relu")
                                    .astype(F32)))(jnp.asarray(bias.astype(dtype)))
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + bias.astype(dtype).astype(np.float64)
    assert db.dtype == dtype
    assert rel_error(db, (z > 0).sum(0)) <= 2 * TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("config", ep_config.DENSE_CONFIGS, ids=_config_ids(ep_config.DENSE_CONFIGS))
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "gelu_erf", "silu"])
def test_kernel_activation_grad_matches_float64(rng, activation, config):
    m, k, n = 900, 640, 392  # dz [m, n] = (dy [m, k] @ w[n, k]^T) * act'(z [m, n])
    dy = random_array(rng, (m, k), BF16)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(BF16)
    z = random_array(rng, (m, n), BF16)
    out, = _poisoned(jnp.asarray(dy), jnp.asarray(w), jnp.asarray(z), kind=ep_config.GRADIENT,
                     activation=activation, has_aux=True, b_k_major=True, out_dtype=BF16,
                     config=config)
    slope = f64_act_grad(activation, z)
    ref = (np.asarray(dy, np.float64) @ np.asarray(w, np.float64).T) * slope
    assert rel_error(out, ref) <= TOL[BF16]


def _stable_act(name, z):
    """act(z) and act'(z) in float64, in forms without cancellation for negative z (GELU as
    z sigmoid(2u) and 0.5 z erfc(-z / sqrt 2)): the references of the elementwise tests."""
    from math import erfc
    z = np.asarray(z, np.float64)
    if name == "silu":
        s = 1 / (1 + np.exp(-z))
        return z * s, s * (1 + z * (1 - s))
    if name == "gelu_tanh":
        c = np.sqrt(2 / np.pi)
        v = 2 * c * (z + 0.044715 * z ** 3)
        s = 1 / (1 + np.exp(-v))
        return z * s, s + z * s * (1 - s) * 2 * c * (1 + 3 * 0.044715 * z ** 2)
    if name == "gelu_erf":
        phi = 0.5 * np.vectorize(erfc)(-z / np.sqrt(2))
        return z * phi, phi + z * np.exp(-0.5 * z ** 2) / np.sqrt(2 * np.pi)
    raise ValueError(name)


# z on a grid over [lo, 4] (bf16 values) with lo = -8: the negative tail, where tanh GELU's
# textbook form 0.5 z (1 + tanh(u)) loses every bit to cancellation. The exact GELU keeps
# 1 + erf(...) (csrc/epilogue/fusion.cuh), within a bf16 rounding down to z = -4.
def _tail_z(lo):
    return np.linspace(lo, 4.0, 256 * 192).astype(BF16).reshape(256, 192)


TAIL_CASES = [("silu", None), ("gelu_tanh", None), ("gelu_tanh", jax_tma.GemmConfig(128, 256, 3, 1)),
              ("gelu_tanh", jax_tma.GemmConfig(64, 128, 8, 1)), ("gelu_erf", None)]


@pytest.mark.gpu
@pytest.mark.parametrize("activation,config", TAIL_CASES,
                         ids=[a + ("-" + _config_ids([c])[0] if c else "") for a, c in TAIL_CASES])
def test_kernel_activation_elementwise_in_the_tails(activation, config):
    """Each output of act(x @ w) and of (dy @ w^T) * act'(z) within a bf16 rounding (plus 1e-6
    absolute for act', which crosses zero) of the float64 value, for z over [-8, 4] ([-4, 4]
    for the exact GELU): x @ w = z exactly (w the identity), dy @ w^T = 1 exactly."""
    z = _tail_z(-4.0 if activation == "gelu_erf" else -8.0)
    m, n = z.shape
    want, want_grad = _stable_act(activation, z)
    eye = np.eye(n, dtype=np.float32).astype(BF16)
    out, = _poisoned(jnp.asarray(z), jnp.asarray(eye), kind=ep_config.FORWARD, activation=activation,
                     out_dtype=BF16, config=config)
    bad = np.abs(out - want) > 2.0 ** -8 * np.abs(want)
    assert not bad.any(), (f"{bad.sum()} outputs off, e.g. z = {z.astype(np.float64)[bad][:4]}: "
                           f"{out[bad][:4]} against {want[bad][:4]}")
    ones = np.zeros((m, 64), np.float32)
    ones[:, 0] = 1
    w = np.zeros((n, 64), np.float32)
    w[:, 0] = 1
    grad, = _poisoned(jnp.asarray(ones.astype(BF16)), jnp.asarray(w.astype(BF16)), jnp.asarray(z),
                      kind=ep_config.GRADIENT, activation=activation, has_aux=True, b_k_major=True,
                      out_dtype=BF16, config=config)
    bad = np.abs(grad - want_grad) > 2.0 ** -8 * np.abs(want_grad) + 1e-6
    assert not bad.any(), (f"{bad.sum()} gradients off, e.g. z = {z.astype(np.float64)[bad][:4]}"
                           f": {grad[bad][:4]} against {want_grad[bad][:4]}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", ep_config.DENSE_CONFIGS, ids=_config_ids(ep_config.DENSE_CONFIGS))
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu_erf"])
def test_kernel_gated_matches_float64(rng, activation, config):
    m, k, n = 1000, 384, 456
    x, wg = _operands(rng, m, k, n, BF16)
    wu = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(BF16)
    out, pre = _poisoned(jnp.asarray(x), jnp.asarray(wg), jnp.asarray(wu), kind=ep_config.GATED,
                         activation=activation, save_pre=True, out_dtype=BF16, config=config)
    assert rel_error(out, f64_gated(x, wg, wu, activation)) <= TOL[BF16]
    x64 = np.asarray(x, np.float64)
    assert rel_error(pre[0], x64 @ np.asarray(wg, np.float64)) <= TOL[BF16]
    assert rel_error(pre[1], x64 @ np.asarray(wu, np.float64)) <= TOL[BF16]


GATED_GRAD_CONFIGS = [*ep_config.configs_for(ep_config.GATED_GRADIENT, "silu"),
                      jax_tma.GemmConfig(128, 256, 3, 1, stream_k=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GATED_GRAD_CONFIGS, ids=_config_ids(GATED_GRAD_CONFIGS))
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("m,k,n", [(1000, 640, 456), (4096, 64, 2304), (4096, 1024, 2304)])
def test_kernel_gated_grad_matches_float64(rng, dtype, activation, config, m, k, n):
    """Both cotangents of the gated product from the epilogue warps, on the ring tiles (one
    K slice a tile and several tiles a CTA; rows and columns past the blocks' edges), each
    output written over a poisoned buffer; a second run is bit-identical."""
    dy = random_array(rng, (m, k), dtype)  # [m, n] = dy [m, k] @ wd[n, k]^T, then the epilogue
    wd = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(dtype)
    pre = random_array(rng, (2, m, n), dtype) * np.asarray(2, dtype)
    params = dict(kind=ep_config.GATED_GRADIENT, activation=activation, has_aux=True, b_k_major=True,
                  out_dtype=dtype, config=config)
    d_gate, d_up = _poisoned(jnp.asarray(dy), jnp.asarray(wd), jnp.asarray(pre), **params)
    want = f64_gated_grads(dy, wd, pre[0], pre[1], activation)
    assert rel_error(d_gate, want[0]) <= TOL[dtype], config
    assert rel_error(d_up, want[1]) <= TOL[dtype], config
    again = _poisoned(jnp.asarray(dy), jnp.asarray(wd), jnp.asarray(pre), **params)
    np.testing.assert_array_equal(again[0], d_gate)
    np.testing.assert_array_equal(again[1], d_up)


@pytest.mark.gpu
def test_kernel_gated_mlp_training_step_matches_xla(rng):
    """gated_mlp's gradients on the kernels against the same block built from lax ops."""
    x, wg = _operands(rng, 1024, 512, 1536, BF16)
    wu = (rng.standard_normal((512, 1536)) / 20).astype(BF16)
    wd = (rng.standard_normal((1536, 512)) / 40).astype(BF16)

    def ours(x, wg, wu, wd):
        return jnp.sum(jax_tma.gated_mlp(x, wg, wu, wd, "silu", x).astype(F32) ** 2)

    def ref(x, wg, wu, wd):
        gate = jnp.dot(x, wg, preferred_element_type=F32).astype(BF16).astype(F32)
        up = jnp.dot(x, wu, preferred_element_type=F32).astype(BF16).astype(F32)
        h = (jax.nn.silu(gate) * up).astype(BF16)
        y = jnp.dot(h, wd, preferred_element_type=F32) + x.astype(F32)
        return jnp.sum(y.astype(BF16).astype(F32) ** 2)

    got = jax.jit(jax.grad(ours, (0, 1, 2, 3)))(x, wg, wu, wd)
    want = jax.jit(jax.grad(ref, (0, 1, 2, 3)))(x, wg, wu, wd)
    for a, b in zip(got, want):
        assert rel_error(a, b) <= 3e-2


# (kind, activation, residual): the warps' fusions of the forward kernels (a residual through
# their ring: bias + silu + residual, whose last tile they keep), of the gated ones and of the
# activation gradient (its pre-activation through their ring).
SEVERAL_TILE_CASES = [("forward", "gelu_tanh", False), ("forward", "relu", False),
                      ("forward", "silu", True), ("gated", "silu", False),
                      ("gated", "gelu_tanh", False), ("gradient", "gelu_tanh", True)]


@pytest.mark.gpu
@pytest.mark.parametrize("k", [64, 1024])
@pytest.mark.parametrize("kind,activation,residual", SEVERAL_TILE_CASES,
                         ids=[f"{k}-{a}" + ("-residual" if r else "")
                              for k, a, r in SEVERAL_TILE_CASES])
def test_kernel_several_tiles_per_cta(rng, kind, activation, residual, k):
    """Products of two or more tiles per CTA with the pre-activations saved, on every compiled
    tile: each block's epilogue (and its pre-activation's stores) through the staging buffers
    while the previous block's stores may still read them; on the offloading tiles, the
    epilogue warps' fusion of every block but a CTA's last, which the consumers store
    themselves (with stream-K, the last is a piece). K = 64: one K slice per tile."""
    # Every compiled tile, and 128 x 256 with stream-K: two whole tiles a CTA, then a piece.
    configs = (*ep_config.DENSE_CONFIGS, jax_tma.GemmConfig(128, 256, 3, 1, stream_k=True))
    m, n = 4096, 1152 if kind == "gated" else 2304
    x, w = _operands(rng, m, k, n, BF16)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    if kind == "gradient":  # out [m, n] = (x [m, k] @ w[n, k]^T) * act'(z [m, n])
        wt = np.ascontiguousarray(w.T)
        z = random_array(rng, (m, n), BF16)
        slope = f64_act_grad(activation, z)
        for config in configs:
            out, = _poisoned(jnp.asarray(x), jnp.asarray(wt), jnp.asarray(z), kind=ep_config.GRADIENT,
                             activation=activation, has_aux=True, b_k_major=True,
                             out_dtype=BF16, config=config)
            assert rel_error(out, (x64 @ w64) * slope) <= TOL[BF16], config
        return
    if kind == "forward":
        bias = rng.standard_normal(n).astype(F32)
        z = x64 @ w64 + bias
        operands = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias))
        want = f64_act(activation, z)
        if residual:
            r = random_array(rng, (m, n), BF16)
            operands += (jnp.asarray(r),)
            want = want + np.asarray(r, np.float64)
        params = dict(kind=ep_config.FORWARD, activation=activation, has_bias=True, has_aux=residual)
        want_pre = [z]
    else:
        wu = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(BF16)
        up = x64 @ np.asarray(wu, np.float64)
        operands, params = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(wu)), dict(
            kind=ep_config.GATED, activation=activation)
        want, want_pre = f64_act(activation, x64 @ w64) * up, [x64 @ w64, up]
    for config in configs:
        out, pre = _poisoned(*operands, save_pre=True, out_dtype=BF16, config=config, **params)
        assert rel_error(out, want) <= TOL[BF16], config
        for got, ref in zip([pre] if kind == "forward" else list(pre), want_pre, strict=True):
            assert rel_error(got, ref) <= TOL[BF16], config
        again, _ = _poisoned(*operands, save_pre=True, out_dtype=BF16, config=config, **params)
        np.testing.assert_array_equal(out, again)
        if not residual:  # without the pre-activations: the fused pass alone
            alone, = _poisoned(*operands, out_dtype=BF16, config=config, **params)
            np.testing.assert_array_equal(alone, out)


@pytest.mark.gpu
def test_kernel_residual_may_alias_the_output(rng):
    """out = x @ w + r written over r's buffer (donated): each chunk is read before written."""
    x, w = _operands(rng, 512, 256, 512, BF16)
    r = random_array(rng, (512, 512), BF16)
    expected = f64_dense(x, w, residual=r)
    f = jax.jit(lambda x, w, r: jax_tma.dense(x, w, residual=r), donate_argnums=2)
    assert rel_error(f(jnp.asarray(x), jnp.asarray(w), jnp.asarray(r)), expected) <= TOL[BF16]


@pytest.mark.gpu
def test_kernel_training_step_matches_xla(rng):
    """mlp's gradients on the kernels against the same block built from lax ops."""
    x, w1 = _operands(rng, 1024, 512, 1536, BF16)
    w2 = (rng.standard_normal((1536, 512)) / 40).astype(BF16)
    b1, b2 = rng.standard_normal(1536).astype(F32), rng.standard_normal(512).astype(F32)

    def ours(x, w1, w2):
        return jnp.sum(jax_tma.mlp(x, w1, b1, w2, b2, "gelu", x).astype(F32) ** 2)

    def ref(x, w1, w2):
        h = jax.nn.gelu(jnp.dot(x, w1, preferred_element_type=F32) + b1).astype(BF16)
        y = jnp.dot(h, w2, preferred_element_type=F32) + b2 + x.astype(F32)
        return jnp.sum(y.astype(BF16).astype(F32) ** 2)

    got = jax.jit(jax.grad(ours, (0, 1, 2)))(x, w1, w2)
    want = jax.jit(jax.grad(ref, (0, 1, 2)))(x, w1, w2)
    for a, b in zip(got, want):
        assert rel_error(a, b) <= 3e-2


@pytest.mark.gpu
def test_kernel_decode_rows(rng):
    for m in (1, 16, 64):
        x, w = _operands(rng, m, 1024, 2048, BF16)
        b = rng.standard_normal(2048).astype(BF16)
        out = jax.jit(lambda x, w, b: jax_tma.dense(x, w, b, "silu"))(x, w, b)
        assert rel_error(out, f64_dense(x, w, b, "silu")) <= TOL[BF16]


# ---------------------------------------------------------------- Flax layers (CPU)


def test_flax_linen_layers_match_their_definitions(rng):
    import flax.linen as nn
    import jax_tma.flax as tflax

    x = random_array(rng, (4, 6, 32), BF16)
    dense = tflax.Dense(48, activation="gelu", dtype=jnp.bfloat16)
    params = dense.init(jax.random.key(0), x)
    ref = nn.Dense(48, dtype=jnp.bfloat16)  # same parameter names and layout
    want = jax.nn.gelu(ref.apply(params, x).astype(F32))
    assert rel_error(dense.apply(params, x), want) <= 2 * TOL[BF16]

    mlp = tflax.MLP(64, activation="silu", dtype=jnp.bfloat16)
    params = mlp.init(jax.random.key(1), x)["params"]
    h = jax.nn.silu(x.astype(F32) @ params["up_kernel"] + params["up_bias"])
    want = h.astype(BF16).astype(F32) @ params["down_kernel"] + params["down_bias"] + x.astype(F32)
    got = mlp.apply({"params": params}, x, x)
    assert rel_error(got, want) <= 3 * TOL[BF16]

    gated = tflax.GatedMLP(64, dtype=jnp.bfloat16)
    params = gated.init(jax.random.key(2), x)["params"]
    h = jax.nn.silu(x.astype(F32) @ params["gate_kernel"]) * (x.astype(F32) @ params["up_kernel"])
    want = h.astype(BF16).astype(F32) @ params["down_kernel"]
    assert rel_error(gated.apply({"params": params}, x), want) <= 3 * TOL[BF16]
    grads = jax.grad(lambda p: jnp.sum(gated.apply({"params": p}, x).astype(F32) ** 2))(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_flax_nnx_layers_train(rng):
    from flax import nnx
    import optax
    import jax_tma.flax as tflax

    x = random_array(rng, (64, 32), BF16)
    y = random_array(rng, (64, 32), F32)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.mlp = tflax.NnxMLP(32, 64, dtype=jnp.bfloat16, rngs=rngs)
            self.gated = tflax.NnxGatedMLP(32, 48, dtype=jnp.bfloat16, rngs=rngs)
            self.head = tflax.NnxDense(32, 32, activation="relu", dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, x):
            return self.head(self.gated(self.mlp(x, x), x)).astype(F32)

    model = Block(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(20)]
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------- jax.export


@needs_extension
def test_export_round_trip(rng):
    x, w = _operands(rng, 16, 32, 24, BF16)
    b = rng.standard_normal(24).astype(BF16)
    f = jax.jit(lambda x, w, b: jax_tma.dense(x, w, b, "gelu"))
    exported = jax.export.export(f, platforms=("cpu", "cuda"),
                                 disabled_checks=jax_tma.export_disabled_checks())(
        _spec((16, 32)), _spec((32, 24)), _spec((24,)))
    exported = jax.export.deserialize(exported.serialize())
    assert exported.mlir_module().count(f"@{ep.KERNEL_TARGET}(") == 1
    out = exported.call(jax.device_put(x, jax.devices("cpu")[0]), w, b)
    assert rel_error(out, f64_dense(x, w, b, "gelu")) <= TOL[BF16]


# lax's keywords on the fused ops: an output type other than the operands' or a precision the
# kernel does not compute runs the unfused expression, which lax defines.
@pytest.mark.parametrize("op", ["dense", "gated_dense", "mlp", "gated_mlp"])
def test_preferred_element_type_and_precision_follow_lax(op, rng):
    x = random_array(rng, (3, 5, 64), jnp.bfloat16)
    w1 = random_array(rng, (64, 32), jnp.bfloat16)
    w2 = random_array(rng, (64, 32), jnp.bfloat16)
    wd = random_array(rng, (32, 16), jnp.bfloat16)
    b1 = random_array(rng, (32,), jnp.bfloat16)
    b2 = random_array(rng, (16,), jnp.bfloat16)
    # fp32 out at HIGHEST: the fp32 products (mlp's second) are then fp32 on GPUs too, not TF32.
    f32 = dict(preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    mm = lambda a, b: np.asarray(a, np.float64) @ np.asarray(b, np.float64)  # noqa: E731
    gelu = lambda z: 0.5 * z * (  # noqa: E731
        1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    if op == "dense":
        out = jax_tma.dense(x, w1, b1, "gelu", **f32)
        ref = gelu(mm(x, w1) + np.asarray(b1, np.float64))
    elif op == "gated_dense":
        out = jax_tma.gated_dense(x, w1, w2, "silu", **f32)
        ref = silu(mm(x, w1)) * mm(x, w2)
    elif op == "mlp":
        out = jax_tma.mlp(x, w1, b1, wd, b2, "gelu", **f32)
        ref = mm(gelu(mm(x, w1) + np.asarray(b1, np.float64)), wd) + np.asarray(b2, np.float64)
    else:
        out = jax_tma.gated_mlp(x, w1, w2, wd, "silu", **f32)
        ref = mm(silu(mm(x, w1)) * mm(x, w2), wd)
    assert out.dtype == jnp.float32 and out.shape == ref.shape
    assert rel_error(out, ref) < 1e-5
    # A precision the kernel computes keeps the operands' type.
    kw = dict(precision=lax.Precision.HIGHEST)
    same = {"dense": lambda: jax_tma.dense(x, w1, b1, "gelu", **kw),
            "gated_dense": lambda: jax_tma.gated_dense(x, w1, w2, **kw),
            "mlp": lambda: jax_tma.mlp(x, w1, b1, wd, b2, **kw),
            "gated_mlp": lambda: jax_tma.gated_mlp(x, w1, w2, wd, **kw)}[op]()
    assert same.dtype == jnp.bfloat16
    assert rel_error(same, ref) < 2e-2


def test_mlp_takes_a_config_for_its_first_product():
    x = jnp.ones((4, 64), jnp.bfloat16)
    w1, w2 = jnp.ones((64, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
    ok = jax_tma.mlp(x, w1, None, w2, None, "relu", config=ep_config.DENSE_CONFIGS[0])
    assert ok.shape == (4, 16)
    with pytest.raises((TypeError, ValueError), match="config"):
        jax_tma.mlp(x, w1, None, w2, None, "relu", config="128x128")
