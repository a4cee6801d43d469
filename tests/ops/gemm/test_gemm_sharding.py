"""Sharding of jax_tma.dot_general on 8 CPU devices (tests/conftest.py sets
--xla_force_host_platform_device_count=8), and on two GPUs where there are two.

For every way of sharding a batched product's batch, M, N and K dimensions over the mesh
axes (meshes 8, 4x2, 2x4), the result matches lax.dot_general, carries the expected output
sharding, and the compiled HLO holds exactly the expected collectives: none when only batch,
M and N are sharded, one all-reduce when K is, a reduce-scatter when the requested output
sharding splits over K's axes. Shardy (the default) and the legacy partitioner both.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_tma
from jax_tma.ops.gemm import plan as gemm_plan
from jax_tma.ops.gemm import primitive as gemm
from support import random_array, rel_error

BF16 = np.dtype(ml_dtypes.bfloat16)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# [B, M, K] x [B, K, N] -> [B, M, N], every size divisible by 8.
DIMS = (((2,), (1,)), ((0,), (0,)))
SHAPES = ((8, 32, 64), (8, 64, 16))


def _cpu_mesh(shape, names) -> Mesh:
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(devices[:8]).reshape(shape), names)


MESHES = {"8": ((8,), ("x",)), "4x2": ((4, 2), ("x", "y")), "2x4": ((2, 4), ("x", "y"))}


def _assignments(names):
    """Every assignment of distinct mesh axes to a subset of {batch, m, n, k}."""
    roles = ("batch", "m", "n", "k")
    for count in range(len(names) + 1):
        for subset in itertools.combinations(roles, count):
            for axes in itertools.permutations(names, count):
                yield dict(zip(subset, axes))


CASES = [(mesh_id, a) for mesh_id, (_, names) in MESHES.items() for a in _assignments(names)]


def _collectives(hlo: str) -> set[str]:
    return {c for c in COLLECTIVES if f" {c}(" in hlo or f"{c}-start(" in hlo}


def _operands(seed):
    rng = np.random.default_rng(seed)
    return random_array(rng, SHAPES[0], BF16), random_array(rng, SHAPES[1], BF16)


@pytest.mark.parametrize("mesh_id,assign", CASES, ids=[f"{m}-{a}" for m, a in CASES])
def test_every_sharding_of_batch_m_n_k(mesh_id, assign):
    mesh = _cpu_mesh(*MESHES[mesh_id])
    b, m, n, k = (assign.get(r) for r in ("batch", "m", "n", "k"))
    lhs, rhs = _operands(len(assign))
    lhs_s, rhs_s = NamedSharding(mesh, P(b, m, k)), NamedSharding(mesh, P(b, k, n))
    f = jax.jit(lambda x, y: jax_tma.dot_general(x, y, DIMS))
    x, y = jax.device_put(lhs, lhs_s), jax.device_put(rhs, rhs_s)
    out = f(x, y)
    ref = lax.dot_general(lhs, rhs, DIMS, preferred_element_type=jnp.float32)
    assert out.dtype == BF16 and rel_error(out, ref) <= 1e-2
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(b, m, n)), out.ndim)
    expected = {"all-reduce"} if k else set()
    assert _collectives(f.lower(x, y).compile().as_text()) == expected


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_k_sharded_reduce_scatters_into_a_sharded_output(shardy):
    mesh = _cpu_mesh((4, 2), ("x", "y"))
    lhs, rhs = _operands(1)
    x = jax.device_put(lhs, NamedSharding(mesh, P(None, None, "x")))
    y = jax.device_put(rhs, NamedSharding(mesh, P(None, "x", None)))
    out_s = NamedSharding(mesh, P(None, "x", None))
    with _partitioner(shardy):
        f = jax.jit(lambda x, y: jax_tma.dot_general(x, y, DIMS), out_shardings=out_s)
        hlo = f.lower(x, y).compile().as_text()
        out = f(x, y)
    assert _collectives(hlo) == {"reduce-scatter"}
    assert out.sharding.is_equivalent_to(out_s, out.ndim)
    assert rel_error(out, lax.dot_general(lhs, rhs, DIMS, preferred_element_type=jnp.float32)) <= 1e-2


class _partitioner:
    """Switches between Shardy and the legacy (GSPMD) partitioner for a block."""

    def __init__(self, shardy: bool):
        self.shardy = shardy

    def __enter__(self):
        self.saved = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", self.shardy)

    def __exit__(self, *exc):
        jax.config.update("jax_use_shardy_partitioner", self.saved)


LEGACY_CASES = [{"m": "x"}, {"k": "x"}, {"batch": "x", "n": "y"}, {"m": "y", "k": "x"}]


@pytest.mark.parametrize("assign", LEGACY_CASES, ids=[str(a) for a in LEGACY_CASES])
def test_legacy_partitioner(assign):
    mesh = _cpu_mesh((4, 2), ("x", "y"))
    b, m, n, k = (assign.get(r) for r in ("batch", "m", "n", "k"))
    lhs, rhs = _operands(2)
    x = jax.device_put(lhs, NamedSharding(mesh, P(b, m, k)))
    y = jax.device_put(rhs, NamedSharding(mesh, P(b, k, n)))
    with _partitioner(False):
        f = jax.jit(lambda x, y: jax_tma.dot_general(x, y, DIMS))
        hlo = f.lower(x, y).compile().as_text()
        out = f(x, y)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(b, m, n)), out.ndim)
    assert _collectives(hlo) == ({"all-reduce"} if k else set())
    assert rel_error(out, lax.dot_general(lhs, rhs, DIMS, preferred_element_type=jnp.float32)) <= 1e-2


def test_conflicting_axes_gather_only_what_is_needed():
    """M and N both on "x": M keeps it, so only rhs is gathered along N (not lhs)."""
    mesh = _cpu_mesh((8,), ("x",))
    lhs, rhs = _operands(3)
    x = jax.device_put(lhs, NamedSharding(mesh, P(None, "x", None)))
    y = jax.device_put(rhs, NamedSharding(mesh, P(None, None, "x")))
    f = jax.jit(lambda x, y: jax_tma.dot_general(x, y, DIMS))
    out = f(x, y)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "x", None)), out.ndim)
    assert _collectives(f.lower(x, y).compile().as_text()) == {"all-gather"}
    assert rel_error(out, lax.dot_general(lhs, rhs, DIMS, preferred_element_type=jnp.float32)) <= 1e-2


def test_inside_shard_map():
    mesh = _cpu_mesh((4, 2), ("x", "y"))
    lhs, rhs = _operands(4)
    body = lambda x, y: lax.psum(jax_tma.dot_general(x, y, DIMS, preferred_element_type=jnp.float32), "y")  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x", None, "y"), P("x", "y", None)),
                              out_specs=P("x", None, None)))
    out = f(lhs, rhs)
    assert rel_error(out, lax.dot_general(lhs, rhs, DIMS, preferred_element_type=jnp.float32)) <= 1e-2


def test_grad_of_sharded_dense_layer():
    """Data parallel: x sharded over the batch, w replicated; gradients match lax's."""
    mesh = _cpu_mesh((8,), ("x",))
    rng = np.random.default_rng(5)
    xs, w = random_array(rng, (64, 32), BF16), random_array(rng, (32, 16), BF16)
    x = jax.device_put(xs, NamedSharding(mesh, P("x", None)))
    loss = lambda dot: lambda x, w: jnp.sum(dot(x, w, gemm_plan.MATMUL_DIMS).astype(jnp.float32) ** 2)  # noqa: E731
    ours = jax.jit(jax.grad(loss(jax_tma.dot_general), (0, 1)))(x, w)
    ref = jax.grad(loss(lax.dot_general), (0, 1))(xs, w)
    for o, r in zip(ours, ref):
        assert rel_error(o, r) <= 2e-2


@pytest.mark.smoke
def test_cuda_lowering_keeps_the_partitioning_wrapper():
    """Lowered for CUDA on a sharded mesh, the product is a custom_partitioning call."""
    mesh = _cpu_mesh((8,), ("x",))
    x = jax.ShapeDtypeStruct(SHAPES[0], BF16, sharding=NamedSharding(mesh, P("x")))
    y = jax.ShapeDtypeStruct(SHAPES[1], BF16, sharding=NamedSharding(mesh, P("x")))
    hlo = jax.jit(lambda x, y: jax_tma.dot_general(x, y, DIMS)).trace(x, y).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "CustomSPMDPartitioning" in hlo


# ---------------------------------------------------------------- two GPUs


def _two_gpus():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    return Mesh(np.array(gpus[:2]), ("x",))


@pytest.mark.gpu
@pytest.mark.parametrize("sharded", ["m", "k"])
def test_two_gpus_run_the_kernel_and_match_one(sharded):
    mesh = _two_gpus()
    rng = np.random.default_rng(6)
    lhs, rhs = random_array(rng, (2048, 1024), BF16), random_array(rng, (1024, 512), BF16)
    specs = (P("x", None), P()) if sharded == "m" else (P(None, "x"), P("x", None))
    x = jax.device_put(lhs, NamedSharding(mesh, specs[0]))
    y = jax.device_put(rhs, NamedSharding(mesh, specs[1]))
    f = jax.jit(lambda x, y: jax_tma.dot_general(x, y, gemm_plan.MATMUL_DIMS))
    hlo = f.lower(x, y).compile().as_text()
    assert f'custom_call_target="{gemm.KERNEL_TARGET}"' in hlo
    out = f(x, y)
    single = jax.jit(lambda x, y: jax_tma.dot_general(x, y, gemm_plan.MATMUL_DIMS))(lhs, rhs)
    assert rel_error(out, single) <= 1e-2
    assert {s.device for s in out.addressable_shards} == set(mesh.devices.flat)
