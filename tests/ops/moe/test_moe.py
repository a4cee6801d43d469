"""jax_tma.moe_mlp and the Flax layers on it (jax_tma.flax.MoE, NnxMoE): results and router
statistics against a float64 NumPy reference (routing, capacity and mixing written out token by
token), gradients against a dense jnp form (every expert on every token, masked: no sorting or
gathering), expert parallelism over the forced host devices against one device, input errors,
the kernel calls of a bf16 training step (the gated first half on gated_ragged_dot's kernel),
and on a Hopper GPU that step."""

from __future__ import annotations

import functools
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import jax_tma
import jax_tma.flax as jtf
from jax_tma.ops.fp8 import quantize_primitive as fp8q, ragged_primitive as fp8r
from jax_tma.ops.moe import api as moe_api
from jax_tma.ops.ragged import gated_grad_primitive as ggp, gated_primitive as gp, primitive as rd
from support import cuda_hlo, needs_extension, rel_error, target_calls

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.float32


# ---------------------------------------------------------------- operands and references
def _operands(rng, tokens, d, experts, hidden, gated=True, lead=None):
    """x, router, w_up, w_down, w_gate (None when plain) in fp32, scaled so that every stage's
    values are of order 1."""
    x = rng.standard_normal((*(lead or (tokens,)), d)).astype(F32)
    router = (rng.standard_normal((d, experts)) / math.sqrt(d)).astype(F32)
    w_up = (rng.standard_normal((experts, d, hidden)) / math.sqrt(d)).astype(F32)
    w_down = (rng.standard_normal((experts, hidden, d)) / math.sqrt(hidden)).astype(F32)
    w_gate = (rng.standard_normal((experts, d, hidden)) / math.sqrt(d)).astype(F32) \
        if gated else None
    return x, router, w_up, w_down, w_gate


def _routable_operands(rng, tokens, d, experts, hidden, top_k, tries=50):
    """_operands redrawn until every token's top_k-th and next logits are more than 1e-4 apart
    (reference's condition for the fp32 layer to choose as float64 does)."""
    for _ in range(tries):
        ops = _operands(rng, tokens, d, experts, hidden)
        logits = np.sort(np.asarray(ops[0], np.float64) @ np.asarray(ops[1], np.float64), 1)
        if np.min(logits[:, -top_k] - logits[:, -top_k - 1]) > 1e-4:
            return ops
    raise AssertionError(f"no routable operands in {tries} draws")


def _act64(name, z):
    if name is None:
        return z
    if name == "relu":
        return np.maximum(z, 0)
    if name == "silu":
        return z / (1 + np.exp(-z))
    if name in ("gelu", "gelu_tanh"):
        return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
    return 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))


def reference(x, router, w_up, w_down, w_gate, *, top_k, activation="silu",
              kind="softmax_topk", renormalize=True, capacity_factor=None, devices=None):
    """(y [..., d], stats dict) in float64, token by token. `devices`: the capacity counts per
    (source device, destination device) as under expert parallelism over that many devices."""
    x64 = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
    tokens = x64.shape[0]
    r64 = np.asarray(router, np.float64)
    experts = r64.shape[1]
    logits = x64 @ r64
    if kind == "softmax_topk":
        e = np.exp(logits - logits.max(1, keepdims=True))
        probs = scores = e / e.sum(1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
        probs = scores / scores.sum(1, keepdims=True)
    choice = np.argsort(-scores, axis=1, kind="stable")[:, :top_k]
    ordered = np.sort(logits, axis=1)[:, ::-1]  # both routers' scores grow with the logits
    if top_k < experts:  # the fp32 layer must see the same choice
        assert np.min(ordered[:, top_k - 1] - ordered[:, top_k]) > 1e-4
    top = np.take_along_axis(scores, choice, 1)
    weights = top / top.sum(1, keepdims=True) if renormalize else top
    keep = np.ones((tokens, top_k), bool)
    if capacity_factor is not None:
        if devices is None:
            cap = math.ceil(capacity_factor * tokens * top_k / experts)
            owner = lambda t, e: e  # noqa: E731
        else:
            local = tokens // devices
            cap = min(local * top_k, math.ceil(capacity_factor * local * top_k / devices))
            owner = lambda t, e: (t // local, e // (experts // devices))  # noqa: E731
        used: dict = {}
        for j in range(top_k):  # every token's first choice before any token's second
            for t in range(tokens):
                key = owner(t, choice[t, j])
                used[key] = used.get(key, 0) + 1
                keep[t, j] = used[key] <= cap
    y = np.zeros_like(x64)
    for e in range(experts):
        up = x64 @ np.asarray(w_up[e], np.float64)
        h = (_act64(activation, x64 @ np.asarray(w_gate[e], np.float64)) * up
             if w_gate is not None else _act64(activation, up))
        out = h @ np.asarray(w_down[e], np.float64)
        mix = np.where((choice == e) & keep, weights, 0).sum(1)
        y += mix[:, None] * out
    counts = np.bincount(choice.reshape(-1), minlength=experts)
    z = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    stats = dict(load_balancing_loss=experts * np.sum(counts / (tokens * top_k) * probs.mean(0)),
                 router_z_loss=np.mean(z * z), tokens_per_expert=counts,
                 dropped_fraction=1 - keep.mean(), keep=keep)
    return y.reshape(np.shape(x)), stats


def dense_form(x, router, w_up, w_down, w_gate, *, top_k, activation="silu",
               kind="softmax_topk", renormalize=True, keep=None):
    """The exact layer in fp32 jnp with every expert on every token, masked (the gradients'
    reference: no sorting, gathering or grouped products). `keep` [T, k]: the pairs the
    capacity keeps (reference()'s), None: all."""
    hi = lax.Precision.HIGHEST
    x2 = x.reshape(-1, x.shape[-1])
    logits = jnp.dot(x2, router, precision=hi)
    scores = jax.nn.softmax(logits) if kind == "softmax_topk" else jax.nn.sigmoid(logits)
    probs = scores if kind == "softmax_topk" else scores / scores.sum(-1, keepdims=True)
    top, choice = lax.top_k(scores, top_k)
    weights = top / top.sum(-1, keepdims=True) if renormalize else top
    if keep is not None:
        weights = jnp.where(jnp.asarray(keep), weights, 0.0)
    mix = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(choice, router.shape[1]),
                     precision=hi)
    act = {"silu": jax.nn.silu, "gelu": lambda z: jax.nn.gelu(z, approximate=True),
           "relu": jax.nn.relu}[activation]
    up = jnp.einsum("td,edf->etf", x2, w_up, precision=hi)
    h = act(jnp.einsum("td,edf->etf", x2, w_gate, precision=hi)) * up \
        if w_gate is not None else act(up)
    out = jnp.einsum("etf,efd->etd", h, w_down, precision=hi)
    y = jnp.einsum("te,etd->td", mix, out, precision=hi).reshape(x.shape)
    counts = jnp.zeros(router.shape[1]).at[choice.reshape(-1)].add(1)
    lb = router.shape[1] * jnp.sum(counts / choice.size * probs.mean(0))
    return y, lb


def _check_stats(stats, want, tol=1e-5):
    for name in ("load_balancing_loss", "router_z_loss", "dropped_fraction"):
        got = float(getattr(stats, name))
        assert abs(got - want[name]) <= tol * max(1.0, abs(want[name])), (name, got, want[name])
    np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), want["tokens_per_expert"])


# ---------------------------------------------------------------- one device, fp32
CASES = [  # (tokens or lead dims, d, experts, hidden, top_k, gated, activation, router, renorm)
    ((96,), 32, 8, 16, 2, True, "silu", "softmax_topk", True),
    ((2, 40), 24, 6, 32, 1, True, "gelu", "softmax_topk", False),
    ((128,), 16, 16, 8, 4, False, "relu", "sigmoid_topk", True),
    ((3, 5, 7), 32, 4, 24, 4, False, "gelu_erf", "sigmoid_topk", False),
    ((64,), 40, 8, 48, 8, True, "gelu_tanh", "softmax_topk", True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-E{c[2]}-k{c[4]}-{c[6]}-{c[7]}")
def test_matches_float64(case, rng, exact_f32):
    lead, d, experts, hidden, top_k, gated, act, kind, renorm = case
    x, router, w_up, w_down, w_gate = _operands(rng, None, d, experts, hidden, gated, lead)
    y, stats = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=top_k, activation=act,
                               router=kind, renormalize=renorm, dtype=jnp.float32)
    want, want_stats = reference(x, router, w_up, w_down, w_gate, top_k=top_k, activation=act,
                                 kind=kind, renormalize=renorm)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert rel_error(y, want) <= 1e-5
    _check_stats(stats, want_stats)
    assert float(stats.dropped_fraction) == 0.0


@pytest.mark.parametrize("capacity_factor", [0.25, 0.75, 1.0, 1.5, 100.0])
def test_capacity_drops_as_documented(capacity_factor, rng, exact_f32):
    x, router, w_up, w_down, w_gate = _operands(rng, 96, 32, 8, 16)
    router = router * 4  # uneven routing, so that caps near 1 drop something
    y, stats = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=2,
                               capacity_factor=capacity_factor, dtype=jnp.float32)
    want, want_stats = reference(x, router, w_up, w_down, w_gate, top_k=2,
                                 capacity_factor=capacity_factor)
    assert rel_error(y, want) <= 1e-5
    _check_stats(stats, want_stats)
    if capacity_factor <= 1.0:
        assert float(stats.dropped_fraction) > 0
    if capacity_factor == 100.0:
        exact, _ = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=2, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(exact))


@pytest.mark.parametrize("gated,kind", [(True, "softmax_topk"), (False, "sigmoid_topk")])
def test_gradients_match_dense_form(gated, kind, rng, exact_f32):
    x, router, w_up, w_down, w_gate = _operands(rng, 80, 24, 8, 16, gated)
    act = "silu" if gated else "gelu"
    cotangent = jnp.asarray(rng.standard_normal(x.shape).astype(F32))
    args = (x, router, w_up, w_down) + ((w_gate,) if gated else ())

    def ours(x, router, w_up, w_down, w_gate=None):
        y, stats = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=2, activation=act,
                                   router=kind, dtype=jnp.float32)
        return jnp.sum(y * cotangent) + stats.load_balancing_loss

    def dense(x, router, w_up, w_down, w_gate=None):
        y, lb = dense_form(x, router, w_up, w_down, w_gate, top_k=2, activation=act, kind=kind)
        return jnp.sum(y * cotangent) + lb

    argnums = tuple(range(len(args)))
    got = jax.jit(jax.grad(ours, argnums))(*args)
    want = jax.jit(jax.grad(dense, argnums))(*args)
    for name, g, w in zip(("x", "router", "w_up", "w_down", "w_gate"), got, want):
        assert rel_error(g, w) <= 1e-5, name


def test_forward_mode_with_xla_only(rng, exact_f32):
    """implementation="xla" keeps jax.jvp (its tangent is the gradient's dot with the tangent);
    the kernels' layer is reverse mode only and says so."""
    x, router, w_up, w_down, w_gate = _operands(rng, 64, 16, 4, 8)
    t = rng.standard_normal(x.shape).astype(F32)

    def loss(x, implementation):
        y, _ = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=2, dtype=jnp.float32,
                               implementation=implementation)
        return jnp.sum(jnp.sin(y))

    _, tangent = jax.jvp(lambda x: loss(x, "xla"), (x,), (t,))
    want = jnp.vdot(jax.grad(lambda x: loss(x, "xla"))(x), t)
    assert abs(float(tangent) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda x: loss(x, "jax_tma"), (x,), (t,))


@pytest.mark.parametrize("layout", ["one", "ep4"])
def test_gradients_with_drops_match_dense_form(layout, rng, exact_f32):
    """Where the capacity drops pairs (their rows past every buffer), on one device and over
    four: the gradients of the dense form with the float64 reference's dropped pairs masked."""
    x, router, w_up, w_down, w_gate = _operands(rng, 128, 32, 8, 16)
    router = router * 4
    args = _host(x, router, w_up, w_down, w_gate)
    devices = 4 if layout == "ep4" else None
    mesh = _cpu_mesh((4,), ("ep",)) if devices else None
    kw = dict(top_k=2, capacity_factor=0.5) | (dict(expert_axis="ep", mesh=mesh) if mesh else {})
    _, want_stats = reference(*args, top_k=2, capacity_factor=0.5, devices=devices)
    assert want_stats["dropped_fraction"] > 0
    # The mask is in the float64 choice order: the dense form's fp32 top_k must order alike.
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    _, fp32_choice = lax.top_k(jnp.dot(x, router, precision=lax.Precision.HIGHEST), 2)
    np.testing.assert_array_equal(np.asarray(fp32_choice),
                                  np.argsort(-logits, axis=1, kind="stable")[:, :2])

    def dense_loss(*a):
        y, lb = dense_form(*a, top_k=2, keep=want_stats["keep"])
        return jnp.sum(jnp.sin(y)) + lb

    argnums = (0, 1, 2, 3, 4)
    got = jax.jit(jax.grad(lambda *a: _loss(_moe(**kw), *a), argnums))(*args)
    want = jax.jit(jax.grad(dense_loss, argnums))(*args)
    for name, g, w in zip(("x", "router", "w_up", "w_down", "w_gate"), got, want):
        assert rel_error(g, w) <= 1e-5, name


def test_zero_tokens_and_compute_dtype(rng):
    x, router, w_up, w_down, w_gate = _operands(rng, 0, 16, 4, 8)
    y, stats = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=2, dtype=jnp.bfloat16)
    assert y.shape == (0, 16) and y.dtype == jnp.bfloat16
    assert int(jnp.sum(stats.tokens_per_expert)) == 0
    x, router, w_up, w_down, w_gate = _operands(rng, 64, 16, 4, 8)
    y, _ = jax_tma.moe_mlp(x.astype(BF16), router, w_up, w_down, w_gate, top_k=2)
    assert y.dtype == jnp.bfloat16  # the compute type defaults to x's
    want, _ = reference(x.astype(BF16).astype(F32), router, w_up, w_down, w_gate, top_k=2)
    assert rel_error(y, want) <= 2e-2


# ---------------------------------------------------------------- expert parallelism (CPU)
def _cpu_mesh(shape, names, explicit=False):
    devices = jax.devices("cpu")
    if len(devices) < math.prod(shape):
        pytest.skip(f"needs {math.prod(shape)} CPU devices (conftest forces 8)")
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(np.array(devices[:math.prod(shape)]).reshape(shape), names,
                axis_types=(kind,) * len(shape))


def _host(*arrays):
    """NumPy operands: uncommitted, so that jit lays them out over the CPU mesh."""
    return tuple(None if a is None else np.asarray(a) for a in arrays)


@pytest.mark.parametrize("layout", ["ep8", "ep4-explicit", "data2-ep4"])
def test_expert_parallel_matches_one_device(layout, rng, exact_f32):
    shape, names = {"ep8": ((8,), ("ep",)), "ep4-explicit": ((4,), ("ep",)),
                    "data2-ep4": ((2, 4), ("data", "ep"))}[layout]
    mesh = _cpu_mesh(shape, names, explicit=layout.endswith("explicit"))
    args = _host(*_operands(rng, 128, 32, 16, 24))
    one = _moe(top_k=4)
    y1, s1 = jax.jit(one)(*args)
    g1 = jax.jit(jax.grad(lambda *a: _loss(one, *a), argnums=(0, 1, 2, 3, 4)))(*args)
    ep = _moe(top_k=4, expert_axis="ep", mesh=mesh)
    with jax.set_mesh(mesh):
        y, s = jax.jit(ep)(*args)
        g = jax.jit(jax.grad(lambda *a: _loss(ep, *a), argnums=(0, 1, 2, 3, 4)))(*args)
    assert rel_error(y, y1) <= 1e-6
    for name in ("load_balancing_loss", "router_z_loss", "dropped_fraction"):
        assert abs(float(getattr(s, name)) - float(getattr(s1, name))) <= 1e-5, name
    np.testing.assert_array_equal(np.asarray(s.tokens_per_expert),
                                  np.asarray(s1.tokens_per_expert))
    for a, b in zip(g, g1):
        assert rel_error(a, b) <= 1e-5


def test_expert_parallel_saves_little_for_the_backward(rng):
    """What the backward pass keeps from the forward (jax.vjp's residuals): the exchange saves
    its offsets only. Each device's receive buffers (n times its share of rows, for an exact
    layer) bound the rest at n times the one-device layer's; the CPU exchange's buffers must not
    ride along (platform_dependent's branches would save them on every platform)."""
    devices = 4
    mesh = _cpu_mesh((devices,), ("ep",))
    args = _host(*_operands(rng, 256, 64, 8, 32))

    def saved(f):
        res = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args)
        return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(res))
    with jax.set_mesh(mesh):
        one, ep = saved(_moe(top_k=2)), saved(_moe(top_k=2, expert_axis="ep", mesh=mesh))
    assert ep <= devices * one, (ep, one)


def test_expert_parallel_deepseek_routing_over_8_devices(rng, exact_f32):
    """DeepSeek-V3's routing shape, 256 experts and top-8 with sigmoid scores, over 8 devices
    (32 experts each, 256 ragged slices per exchange): equals the one-device layer, gradients
    too."""
    mesh = _cpu_mesh((8,), ("ep",))
    args = _host(*_operands(rng, 256, 16, 256, 8))
    one = _moe(top_k=8, router="sigmoid_topk")
    ep = _moe(top_k=8, router="sigmoid_topk", expert_axis="ep", mesh=mesh)
    (y1, s1), (y, s) = jax.jit(one)(*args), jax.jit(ep)(*args)
    assert rel_error(y, y1) <= 1e-6
    np.testing.assert_array_equal(np.asarray(s.tokens_per_expert),
                                  np.asarray(s1.tokens_per_expert))
    g1 = jax.jit(jax.grad(lambda *a: _loss(one, *a), argnums=(0, 1, 2, 3, 4)))(*args)
    g = jax.jit(jax.grad(lambda *a: _loss(ep, *a), argnums=(0, 1, 2, 3, 4)))(*args)
    for a, b in zip(g, g1):
        assert rel_error(a, b) <= 1e-5


@pytest.mark.parametrize("layout", ["ep4", "ep8-deepseek"])
def test_expert_parallel_split_slices(layout, rng, exact_f32, monkeypatch):
    """The exchange's slices cut into pieces, at least 7 a destination (16 experts on 4
    devices: 4 slices a destination, cut in 2; 256 experts on 8: 32, left whole) and at the
    default (128), uneven and empty pieces among them: the one-device layer's result and
    gradients, and that many slices lowered."""
    if layout == "ep4":
        mesh, experts, kw = _cpu_mesh((4,), ("ep",)), 16, dict(top_k=4)
        args = _host(*_operands(rng, 128, 32, experts, 24))
    else:
        mesh, experts = _cpu_mesh((8,), ("ep",)), 256
        kw = dict(top_k=8, router="sigmoid_topk")
        args = _host(*_operands(rng, 256, 16, experts, 8))
    devices = dict(mesh.shape)["ep"]
    one = _moe(**kw)
    y1, _ = jax.jit(one)(*args)
    g1 = jax.jit(jax.grad(lambda *a: _loss(one, *a), argnums=(0, 1, 2, 3, 4)))(*args)
    for at_least in (7, moe_api._EXCHANGE_SLICES):
        monkeypatch.setattr(moe_api, "_EXCHANGE_SLICES", at_least)
        ep = _moe(expert_axis="ep", mesh=mesh, **kw)  # a new function: traced anew
        with jax.set_mesh(mesh):
            y, _ = jax.jit(ep)(*args)
            g = jax.jit(jax.grad(lambda *a: _loss(ep, *a), argnums=(0, 1, 2, 3, 4)))(*args)
            cuda = jax.jit(ep).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert rel_error(y, y1) <= 1e-6
        for a, b in zip(g, g1):
            assert rel_error(a, b) <= 1e-5
        per_destination = experts // devices
        slices = devices * per_destination * -(-at_least // per_destination)
        calls = re.findall(r"@ragged_all_to_all\([^)]*\) \{.*?\} : \(([^)]*)\)", cuda)
        assert len(calls) == 2
        for types in calls:  # operand, output, then four [slices] offset and size vectors
            assert types.count(f"tensor<{slices}xi") == 4, (at_least, types)


def test_split_slices_cuts_alike():
    """_split_slices: each slice's rows in order, pieces of ceil(size / pieces) rows, empty
    pieces inside the slice's end; sender and receiver cut the same sizes alike."""
    offsets = jnp.array([0, 5, 5, 12], jnp.int32)
    sizes = jnp.array([5, 0, 7, 3], jnp.int32)
    out = jnp.array([100, 200, 300, 400], jnp.int32)
    a, n, b, r = moe_api._split_slices(3, offsets, sizes, out, sizes)
    np.testing.assert_array_equal(np.asarray(n), [2, 2, 1, 0, 0, 0, 3, 3, 1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(r), np.asarray(n))
    np.testing.assert_array_equal(np.asarray(a), [0, 2, 4, 5, 5, 5, 5, 8, 11, 12, 13, 14])
    np.testing.assert_array_equal(np.asarray(b) - np.asarray(a),
                                  np.repeat(np.asarray(out - offsets), 3))


def _moe(**kw):
    def f(x, router, w_up, w_down, w_gate):
        return jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, dtype=jnp.float32, **kw)
    return f


def _loss(f, *args):
    y, stats = f(*args)
    return jnp.sum(jnp.sin(y)) + stats.load_balancing_loss


@pytest.mark.parametrize("slices", [1, 5, None], ids=["whole_slices", "cut_5", "default"])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 2.0])
def test_expert_parallel_capacity(capacity_factor, slices, rng, exact_f32, monkeypatch):
    if slices is not None:
        monkeypatch.setattr(moe_api, "_EXCHANGE_SLICES", slices)
    devices = 4
    mesh = _cpu_mesh((devices,), ("ep",))
    x, router, w_up, w_down, w_gate = _operands(rng, 128, 32, 8, 16)
    router = router * 3
    f = _moe(top_k=2, capacity_factor=capacity_factor, expert_axis="ep",
                              mesh=mesh)
    y, stats = jax.jit(f)(*_host(x, router, w_up, w_down, w_gate))
    want, want_stats = reference(x, router, w_up, w_down, w_gate, top_k=2,
                                 capacity_factor=capacity_factor, devices=devices)
    assert rel_error(y, want) <= 1e-5
    _check_stats(stats, want_stats)
    if capacity_factor == 0.5:
        assert float(stats.dropped_fraction) > 0


def test_expert_parallel_exchange_is_capacity_sized(rng):
    """Only the routed rows travel: each expert's rows as ragged slices out and back (XLA's ragged
    all-to-all where the platform has it), into a receive buffer of n * C rows,
    C = ceil(cf * T_local * k / n) per device pair."""
    mesh = _cpu_mesh((4,), ("ep",))
    args = _host(*_operands(rng, 256, 32, 8, 16))
    f = _moe(top_k=2, capacity_factor=1.25, expert_axis="ep", mesh=mesh)
    capacity = math.ceil(1.25 * 64 * 2 / 4)  # 40 rows, against T_local * k = 128
    cuda = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert f"tensor<{4 * capacity}x32xf32>" in cuda
    assert "tensor<512x32xf32>" not in cuda  # n * T_local * k: the exact layer's buffer
    assert cuda.count("@ragged_all_to_all") == 2, "rows out, results back"
    assert "all_to_all" not in cuda.replace("ragged_all_to_all", "")
    grad = jax.jit(jax.grad(lambda *a: _loss(f, *a), argnums=(0, 1, 2, 3, 4)))
    cuda = grad.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count("@ragged_all_to_all") == 4, "and both again, transposed"


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs,message", [
    (dict(top_k=5), "top_k must be an int in"),
    (dict(top_k=0), "top_k must be an int in"),
    (dict(top_k=2, activation="tanh"), "activation must be one of"),
    (dict(top_k=2, activation=None), "activation must be one of"),  # gated needs one
    (dict(top_k=2, router="softmax"), "router must be one of"),
    (dict(top_k=2, capacity_factor=0.0), "capacity_factor must be None"),
    (dict(top_k=2, capacity_factor=float("nan")), "capacity_factor must be None"),
    (dict(top_k=2, implementation="pallas"), "implementation must be one of"),
    (dict(top_k=2, dtype=jnp.int8), "dtype must be floating"),
    (dict(top_k=2, dtype=jnp.float16, implementation="jax_tma_fp8"),
     "'jax_tma_fp8' computes in bfloat16 or float32.*float16"),
])
def test_bad_options(kwargs, message, rng):
    x, router, w_up, w_down, w_gate = _operands(rng, 16, 8, 4, 8)
    with pytest.raises((ValueError, TypeError), match=message):
        jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, **kwargs)


def test_bad_shapes_and_dtypes(rng):
    x, router, w_up, w_down, w_gate = _operands(rng, 16, 8, 4, 8)
    with pytest.raises(ValueError, match=r"x \[16, 9\].*w_up \[4, 8, 8\]"):
        jax_tma.moe_mlp(x[:, :1].repeat(9, 1), router, w_up, w_down, w_gate, top_k=2)
    with pytest.raises(ValueError, match="w_down"):
        jax_tma.moe_mlp(x, router, w_up, w_down[:, :, :4], w_gate, top_k=2)
    with pytest.raises(ValueError, match="w_gate"):
        jax_tma.moe_mlp(x, router, w_up, w_down, w_gate[:3], top_k=2)
    with pytest.raises(ValueError, match=r"router_kernel \[d, E\]; got .*router_kernel "
                                         r"\[1, 8, 4\]"):
        jax_tma.moe_mlp(x, router[None], w_up, w_down, w_gate, top_k=2)
    with pytest.raises(TypeError, match="x must be floating point, got int32"):
        jax_tma.moe_mlp(x.astype(np.int32), router, w_up, w_down, w_gate, top_k=2)


def test_bad_expert_axis(rng):
    x, router, w_up, w_down, w_gate = _operands(rng, 16, 8, 6, 8)
    with pytest.raises(ValueError, match="no mesh is set"):
        jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=2, expert_axis="ep")
    mesh = _cpu_mesh((4,), ("ep",))
    with pytest.raises(ValueError, match=r"expert_axis='x' is not an axis of the mesh; "
                       r"the mesh's axes are \('ep',\)"):
        jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=2, expert_axis="x", mesh=mesh)
    with pytest.raises(ValueError, match=r"experts \(6\) and the tokens \(16.*multiples of 4"):
        jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=2, expert_axis="ep", mesh=mesh)


# ---------------------------------------------------------------- Flax layers
def test_linen_layer(rng, exact_f32):
    x = jnp.asarray(rng.standard_normal((2, 24, 32)).astype(F32))
    layer = jtf.MoE(num_experts=8, top_k=2, hidden_dim=16, dtype=jnp.float32)
    params = jax.jit(layer.init)(jax.random.key(0), x)["params"]
    assert {k: v.shape for k, v in params.items()} == {
        "router": (32, 8), "gate": (8, 32, 16), "up": (8, 32, 16), "down": (8, 16, 32)}
    y, state = jax.jit(lambda p, x: layer.apply(p, x, mutable=["intermediates"]))(
        {"params": params}, x)
    want, want_stats = reference(x, params["router"], params["up"], params["down"],
                                 params["gate"], top_k=2)
    assert rel_error(y, want) <= 1e-5
    sown = state["intermediates"]
    assert abs(float(sown["load_balancing_loss"][0]) - want_stats["load_balancing_loss"]) < 1e-5
    assert set(sown) == {"load_balancing_loss", "router_z_loss", "tokens_per_expert",
                         "dropped_fraction"}
    plain = jtf.MoE(num_experts=8, top_k=2, hidden_dim=16, gated=False, activation="relu")
    assert set(jax.eval_shape(plain.init, jax.random.key(0), x)["params"]) == {
        "router", "up", "down"}


def test_linen_layer_expert_axis_annotates_params():
    mesh = _cpu_mesh((4,), ("ep",))
    layer = jtf.MoE(num_experts=8, top_k=2, hidden_dim=16, expert_axis="ep", mesh=mesh)
    variables = jax.eval_shape(layer.init, jax.random.key(0), jnp.ones((8, 32)))
    specs = nn_partition_specs(variables)
    assert specs["up"] == P("ep", None, None) and specs["router"] is None


def nn_partition_specs(variables):
    import flax.linen as nn  # noqa: PLC0415
    specs = nn.get_partition_spec(variables)["params"]
    return {k: (v if isinstance(v, P) and v != P() else None) for k, v in specs.items()}


def test_nnx_layer_matches_linen(rng, exact_f32):
    from flax import nnx  # noqa: PLC0415
    x = jnp.asarray(rng.standard_normal((40, 32)).astype(F32))
    layer = jtf.NnxMoE(32, 8, 2, 16, dtype=jnp.float32, router="sigmoid_topk",
                       rngs=nnx.Rngs(0))
    y, sown = nnx.capture(layer, nnx.Intermediate)(x)
    linen = jtf.MoE(num_experts=8, top_k=2, hidden_dim=16, dtype=jnp.float32,
                    router="sigmoid_topk")
    params = {name: getattr(layer, name)[...] for name in ("router", "gate", "up", "down")}
    np.testing.assert_allclose(np.asarray(y), np.asarray(linen.apply({"params": params}, x)),
                               rtol=1e-6, atol=1e-6)
    assert set(sown) == {"load_balancing_loss", "router_z_loss", "tokens_per_expert",
                         "dropped_fraction"}
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(y))  # outside capture too


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_experts=4, top_k=5, hidden_dim=8), "top_k must be an int in"),
    (dict(num_experts=0, top_k=1, hidden_dim=8), "num_experts must be a positive int"),
    (dict(num_experts=4, top_k=2, hidden_dim=0), "hidden_dim must be a positive int"),
    (dict(num_experts=4, top_k=2, hidden_dim=8, gated=False, activation="swish"),
     "activation must be one of"),
])
def test_layers_reject_bad_options_at_construction(kwargs, message):
    from flax import nnx  # noqa: PLC0415
    with pytest.raises(ValueError, match=r"jax_tma\.flax\.MoE: " + message):
        jtf.MoE(**kwargs)
    with pytest.raises(ValueError, match=r"jax_tma\.flax\.NnxMoE: " + message):
        jtf.NnxMoE(16, kwargs.pop("num_experts"), kwargs.pop("top_k"), kwargs.pop("hidden_dim"),
                   rngs=nnx.Rngs(0), **kwargs)


# ---------------------------------------------------------------- the kernels
def _kernel_calls(hlo: str, target: str = rd.KERNEL_TARGET) -> int:
    return target_calls(hlo, target)


def _step_fn(implementation="jax_tma", gated=True, **kw):
    """Loss and gradients of a bf16 layer (x, router, w_up, w_down[, w_gate])."""
    def loss(x, router, w_up, w_down, w_gate=None):
        y, stats = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=2,
                                   dtype=jnp.bfloat16, implementation=implementation, **kw)
        return jnp.sum(y.astype(jnp.float32) ** 2) + 1e-2 * stats.load_balancing_loss
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4) if gated else (0, 1, 2, 3))


@needs_extension
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_cuda_lowering_kernel_calls(gated):
    """Gated experts (gated_ragged_mlp): forward, the gated kernel (saving the
    pre-activations) and ragged_dot's down product; backward, the gated gradient kernel (dy @
    w_down^T with the gate's and the up's cotangents from its epilogue), the rows' gradient
    against w_gate and against w_up and the three weight gradients: 1 gated call, 1 gated
    gradient call and 6 ragged_dot calls. Plain experts: the up and the down product, each
    one's weight and input gradient (the first's reaches x): 6 ragged_dot calls.
    implementation="xla": none of them."""
    specs = [jax.ShapeDtypeStruct(s, F32) for s in
             ((512, 64), (64, 8), (8, 64, 128), (8, 128, 64), (8, 64, 128))]
    args = specs if gated else specs[:4]
    hlo = cuda_hlo(_step_fn(gated=gated), *args)
    assert _kernel_calls(hlo, gp.KERNEL_TARGET) == (1 if gated else 0)
    assert _kernel_calls(hlo, ggp.KERNEL_TARGET) == (1 if gated else 0)
    assert _kernel_calls(hlo) == 6
    xla = cuda_hlo(_step_fn("xla"), *specs)
    assert (_kernel_calls(xla) == _kernel_calls(xla, gp.KERNEL_TARGET)
            == _kernel_calls(xla, ggp.KERNEL_TARGET) == 0)


@pytest.mark.gpu
def test_gpu_bf16_step_runs_kernel(rng):
    x, router, w_up, w_down, w_gate = _routable_operands(rng, 2048, 256, 16, 512, top_k=2)
    args = tuple(jnp.asarray(a) for a in (x, router, w_up, w_down, w_gate))
    step = jax.jit(_step_fn())
    compiled = step.lower(*args).compile().as_text()
    assert (_kernel_calls(compiled, gp.KERNEL_TARGET), _kernel_calls(compiled, ggp.KERNEL_TARGET),
            _kernel_calls(compiled)) == (1, 1, 6)
    y, _ = jax.jit(lambda *a: jax_tma.moe_mlp(*a, top_k=2, dtype=jnp.bfloat16))(*args)
    want, _ = reference(x, router, w_up, w_down, w_gate, top_k=2)
    assert rel_error(y, want) <= 2e-2
    (_, grads) = step(*args)
    (_, xla_grads) = jax.jit(_step_fn("xla"))(*args)
    for name, g, w in zip(("x", "router", "w_up", "w_down", "w_gate"), grads, xla_grads):
        assert rel_error(g, w) <= 3e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("slices", [1, 64], ids=["whole_slices", "cut_slices"])
def test_gpu_expert_parallel_matches_one_gpu(slices, rng, monkeypatch):
    """Experts sharded over every GPU (2+): the routed rows cross by XLA's ragged all-to-all
    (its slices whole, or cut into 64 a destination), the grouped kernels run on each GPU, and
    the step equals the one-GPU layer's."""
    monkeypatch.setattr(moe_api, "_EXCHANGE_SLICES", slices)
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("needs two or more GPUs")
    n = 4 if len(gpus) >= 4 else 2
    mesh = Mesh(np.array(gpus[:n]), ("ep",))
    x, router, w_up, w_down, w_gate = _routable_operands(rng, 1024, 256, 8, 384, top_k=2)
    args = tuple(jnp.asarray(a) for a in (x, router, w_up, w_down, w_gate))
    one = jax.jit(_step_fn())
    ep = jax.jit(_step_fn(expert_axis="ep", mesh=mesh))
    compiled = ep.lower(*args).compile().as_text()
    assert _kernel_calls(compiled, gp.KERNEL_TARGET) == 1
    assert "ragged-all-to-all" in compiled or "ragged_all_to_all" in compiled
    (loss1, grads1), (loss, grads) = one(*args), ep(*args)
    assert abs(float(loss) - float(loss1)) <= 1e-3 * abs(float(loss1))
    for name, g, w in zip(("x", "router", "w_up", "w_down", "w_gate"), grads, grads1):
        assert rel_error(g, w) <= 1e-2, name


@pytest.mark.parametrize("layout", ["one", "ep4"])
def test_fp32_weights_take_fp32_gradients(layout, rng):
    """fp32 weights of a bf16 layer are cast inside the gated grouped MLP: the same forward and
    input gradient bit for bit as the same weights cast to bf16 by the caller, and fp32 weight
    gradients within bf16's rounding of the bf16 weights' (2^-9 relative at most) but not
    equal to them (the kernels' fp32 sums, not rounded to bf16)."""
    x, router, w_up, w_down, w_gate = _routable_operands(rng, 128, 64, 8, 128, top_k=2)
    args = _host(x, router, w_up, w_down, w_gate)
    cast = args[:2] + tuple(w.astype(jnp.bfloat16) for w in args[2:])
    kw = dict(expert_axis="ep", mesh=_cpu_mesh((4,), ("ep",))) if layout == "ep4" else {}
    step = jax.jit(_step_fn(**kw))
    (l0, g0), (l1, g1) = step(*cast), step(*args)
    assert float(l1) == float(l0)
    for name, a, b in zip(("x", "router", "w_up", "w_down", "w_gate"), g1, g0):
        assert a.dtype == jnp.float32, name
        if name in ("x", "router"):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        else:
            assert b.dtype == jnp.bfloat16, name
            assert 0 < rel_error(a, b.astype(jnp.float32)) <= 4e-3, name


# ---------------------------------------------------------------- FP8 experts
# implementation="jax_tma_fp8": e4m3 rows (1 x 128) and weights (128 x 128) at every product,
# each rounding to 3 mantissa bits ~2-3 % relative at random data; a gated expert's path rounds
# four operands so: 5-6.5 % from the exact float64 layer here (forward and gradients). The bound
# leaves room for that, not for a misplaced block or scale (errors of order 1) nor for a
# gradient off by a fifth.
FP8_TOL = 0.1
EP_FP8_TOL = 3e-3


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_fp8_experts_match_float64(gated, rng):
    x, router, w_up, w_down, w_gate = _routable_operands(rng, 160, 256, 8, 192, top_k=2)
    w_gate = w_gate if gated else None
    act = "silu" if gated else "gelu"
    for dtype, tol in ((jnp.float32, FP8_TOL), (jnp.bfloat16, FP8_TOL + 1e-2)):
        y, stats = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=2, activation=act,
                                   dtype=dtype, implementation="jax_tma_fp8")
        want, want_stats = reference(x, router, w_up, w_down, w_gate, top_k=2, activation=act)
        assert y.dtype == dtype and y.shape == x.shape
        assert rel_error(y, want) <= tol
        _check_stats(stats, want_stats)
    # The FP8 products ran: against the same layer's 16-bit-free float32 products, FP8's
    # rounding (a few %) shows.
    kw = dict(top_k=2, activation=act, dtype=jnp.float32)
    fp8_y, _ = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, implementation="jax_tma_fp8", **kw)
    f32_y, _ = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, **kw)
    assert rel_error(fp8_y, f32_y) > 1e-2


@pytest.mark.parametrize("gated,hidden", [(True, 128), (True, 192), (False, 128)],
                         ids=["gated", "gated-straddle", "plain"])
def test_fp8_gradients_match_dense_form(gated, hidden, rng):
    """hidden 192: a 128-column block of the gate and up weights side by side spans both."""
    x, router, w_up, w_down, w_gate = _routable_operands(rng, 128, 256, 8, hidden, top_k=2)
    w_gate = w_gate if gated else None
    act = "silu" if gated else "gelu"
    cotangent = jnp.asarray(rng.standard_normal(x.shape).astype(F32))
    args = (x, router, w_up, w_down) + ((w_gate,) if gated else ())

    def ours(x, router, w_up, w_down, w_gate=None):
        y, _ = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, top_k=2, activation=act,
                               dtype=jnp.float32, implementation="jax_tma_fp8")
        return jnp.sum(y * cotangent)

    def dense(x, router, w_up, w_down, w_gate=None):
        y, _ = dense_form(x, router, w_up, w_down, w_gate, top_k=2, activation=act)
        return jnp.sum(y * cotangent)

    argnums = tuple(range(len(args)))
    got = jax.jit(jax.grad(ours, argnums))(*args)
    want = jax.jit(jax.grad(dense, argnums))(*args)
    for name, g, w in zip(("x", "router", "w_up", "w_down", "w_gate"), got, want):
        assert g.dtype == w.dtype, name
        assert rel_error(g, w) <= FP8_TOL, name


@jax.custom_vjp
def _straight_through_blocks(w):
    """The one-pass quantiser's (values, scales) of w [E, K, N], its values' cotangent reaching
    w unchanged (quantize_fp8's straight-through rule)."""
    return fp8q.quantize_blocks(w, with_transpose=False)


_straight_through_blocks.defvjp(lambda w: (_straight_through_blocks(w), None),
                                lambda _, cts: (cts[0].astype(F32),))


@pytest.mark.parametrize("hidden", [128, 192])
def test_fp8_product_matches_fp8_ragged_dot(hidden, rng):
    """The layer's FP8 product (the weights side by side, quantised in one pass with their
    K-major copy) against fp8_ragged_dot of the same rows and e4m3 blocks read K-major: the
    same forward and rows' gradient bit for bit, and the weights' gradients up to the bf16
    rounding fp8_ragged_dot's give them (the layer's keep the fp32 sums for fp32 weights).
    hidden 192: a block spans gate and up. (The quantiser against quantize_fp8:
    tests/ops/fp8/test_quantize_kernel.py.)"""
    g, d = 8, 256
    rows = jnp.asarray(rng.standard_normal((160, d)).astype(F32))
    ws = tuple(jnp.asarray(rng.standard_normal((g, d, hidden)).astype(F32) / 16)
               for _ in range(2))
    sizes = jnp.asarray([30, 0, 1, 50, 7, 40, 12, 20], jnp.int32)  # 160 rows, an empty group
    ct = jnp.asarray(rng.standard_normal((160, 2 * hidden)).astype(F32))

    def ours(rows, w0, w1):
        return moe_api._fp8_product(rows, (w0, w1), sizes, jnp.float32)

    def public(rows, w0, w1):
        xq, xs = jax_tma.quantize_fp8(rows, (1, 128))
        wq, wsc = _straight_through_blocks(jnp.concatenate([w0, w1], -1))
        return jax_tma.fp8_ragged_dot(xq, jnp.swapaxes(wq, 1, 2), xs, jnp.swapaxes(wsc, 1, 2),
                                      sizes, preferred_element_type=F32)

    results = []
    for f in (ours, public):
        y, vjp = jax.vjp(jax.jit(f), rows, *ws)
        results.append((y, vjp(ct)))
    (y1, g1), (y0, g0) = results
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
    assert rel_error(g1[0], g0[0]) <= 1e-5
    for a, b in zip(g1[1:], g0[1:]):
        assert a.dtype == b.dtype == jnp.float32
        assert rel_error(a, b) <= 4e-3


def test_fp8_expert_parallel_matches_one_device(rng):
    x, router, w_up, w_down, w_gate = _routable_operands(rng, 128, 256, 8, 128, top_k=2)
    kw = dict(top_k=2, dtype=jnp.float32, implementation="jax_tma_fp8")
    # One CPU device against the CPU mesh: the same XLA products on either side (on a GPU the
    # one-device layer would run the FP8 kernels). Each side quantises the hidden activations
    # after fp32 sums in its own order, so a few land on the other side of an e4m3 rounding
    # step (1.3e-4 in the output with jax 0.11.2's CPU backend; the gradients go through the
    # same quantised activations): EP_FP8_TOL is a thirtieth of FP8_TOL, the bound on the FP8
    # products' own error, and far under a misrouted row.
    def one():
        return jax.default_device(jax.devices("cpu")[0])

    with one():
        want, _ = jax_tma.moe_mlp(x, router, w_up, w_down, w_gate, **kw)
    with jax.set_mesh(_cpu_mesh((4,), ("ep",))):
        got, _ = jax.jit(lambda *a: jax_tma.moe_mlp(*a, expert_axis="ep", **kw))(
            x, router, w_up, w_down, w_gate)
    assert rel_error(_host(got)[0], want) <= EP_FP8_TOL
    args = (x, router, w_up, w_down, w_gate)
    ct = rng.standard_normal(x.shape).astype(F32)

    def loss(*a, **more):
        return jnp.sum(jax_tma.moe_mlp(*a, **kw, **more)[0] * ct)

    with one():
        want_grads = jax.jit(jax.grad(loss, range(5)))(*args)
    with jax.set_mesh(_cpu_mesh((4,), ("ep",))):
        got_grads = jax.jit(jax.grad(functools.partial(loss, expert_axis="ep"), range(5)))(*args)
    for name, g, w in zip(("x", "router", "w_up", "w_down", "w_gate"), got_grads, want_grads):
        assert rel_error(_host(g)[0], w) <= EP_FP8_TOL, name


@needs_extension
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_fp8_cuda_lowering_kernel_calls(gated):
    """FP8 experts: forward, the up (gated: gate and up together) and the down product on the
    FP8 grouped kernel; backward, each one's input gradient on it too and each weight's
    gradient on the bf16 grouped kernel (gated: the gate's and the up's apart): 4 FP8 calls
    and 3 (gated) or 2 ragged_dot calls; the up (gate and up) and the down weights each
    quantised by one call of the one-pass quantiser."""
    specs = [jax.ShapeDtypeStruct(s, F32) for s in
             ((512, 256), (256, 8), (8, 256, 128), (8, 128, 256), (8, 256, 128))]
    hlo = cuda_hlo(_step_fn("jax_tma_fp8", gated), *(specs if gated else specs[:4]))
    assert _kernel_calls(hlo, fp8r.KERNEL_TARGET) == 4
    assert _kernel_calls(hlo) == (3 if gated else 2)
    assert _kernel_calls(hlo, fp8q.KERNEL_TARGET) == 2  # the weights' one-pass quantiser
    assert _kernel_calls(hlo, gp.KERNEL_TARGET) == _kernel_calls(hlo, ggp.KERNEL_TARGET) == 0


@pytest.mark.gpu
def test_gpu_fp8_step_runs_kernel(rng):
    x, router, w_up, w_down, w_gate = _routable_operands(rng, 2048, 256, 16, 512, top_k=2)
    args = tuple(jnp.asarray(a) for a in (x, router, w_up, w_down, w_gate))
    step = jax.jit(_step_fn("jax_tma_fp8"))
    compiled = step.lower(*args).compile().as_text()
    assert (_kernel_calls(compiled, fp8r.KERNEL_TARGET), _kernel_calls(compiled)) == (4, 3)
    y, _ = jax.jit(lambda *a: jax_tma.moe_mlp(*a, top_k=2, dtype=jnp.bfloat16,
                                              implementation="jax_tma_fp8"))(*args)
    want, _ = reference(x, router, w_up, w_down, w_gate, top_k=2)
    assert rel_error(y, want) <= FP8_TOL + 1e-2
    (_, grads) = step(*args)
    (_, xla_grads) = jax.jit(_step_fn("xla"))(*args)
    for name, g, w in zip(("x", "router", "w_up", "w_down", "w_gate"), grads, xla_grads):
        assert rel_error(g, w) <= FP8_TOL + 1e-2, name  # bf16 products


def _example():
    """examples/flax_moe.py as a module."""
    import sys  # noqa: PLC0415
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "examples"))
    import flax_moe  # noqa: PLC0415
    return flax_moe


@needs_extension
def test_fp8_example_step_kernel_calls():
    """examples/flax_moe.py --fp8's training step lowers to the calls the example expects: the
    gate-and-up and the down product and the down product's input gradient in FP8, the three
    weight gradients on the bf16 grouped kernel (the rows come from data: no input gradient)."""
    flax_moe = _example()
    s = flax_moe.setup(tokens=256, d_model=128, d_ff=128, experts=4, top_k=2, fp8=True)
    hlo = jax.jit(s.step).trace(s.params, s.opt_state, *s.batches[0]).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = (_kernel_calls(hlo, fp8r.KERNEL_TARGET), _kernel_calls(hlo))
    assert calls == (3, 3) and sum(calls) == flax_moe.expected_kernel_calls()
    assert _kernel_calls(hlo, gp.KERNEL_TARGET) == _kernel_calls(hlo, ggp.KERNEL_TARGET) == 0


def test_fp8_example_tracks_the_bf16_layer():
    flax_moe = _example()
    kw = dict(tokens=256, d_model=128, d_ff=128, experts=4, top_k=2, dtype="bf16")
    fp8 = flax_moe.run(flax_moe.setup(fp8=True, **kw), 20)
    bf16 = flax_moe.run(flax_moe.setup(**kw), 20)
    assert fp8[-1] < 0.8 * fp8[0]
    assert flax_moe.max_relative_difference(fp8, bf16) <= flax_moe.FP8_TOLERANCE


def test_nnx_layer_expert_parallel(rng, exact_f32):
    """NnxMoE with expert_axis, built inside jax.set_mesh: expert parameters sharded over the
    axis, the result the one-device layer's."""
    from flax import nnx  # noqa: PLC0415
    mesh = _cpu_mesh((4,), ("ep",))
    x = rng.standard_normal((64, 32)).astype(F32)
    with jax.set_mesh(mesh):
        layer = jtf.NnxMoE(32, 8, 2, 16, dtype=jnp.float32, expert_axis="ep", rngs=nnx.Rngs(0))
        assert layer.up[...].sharding.spec == P("ep", None, None)
        y = jax.jit(lambda x: layer(x))(x)
    params = {name: np.asarray(getattr(layer, name)[...]) for name in ("router", "gate", "up",
                                                                       "down")}
    one = jtf.MoE(num_experts=8, top_k=2, hidden_dim=16, dtype=jnp.float32)
    assert rel_error(y, jax.jit(one.apply)({"params": params}, x)) <= 1e-6
