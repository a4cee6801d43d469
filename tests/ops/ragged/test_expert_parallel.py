"""The ops inside ``jax.shard_map`` (manual sharding, check_vma on: every value knows the mesh
axes it varies along) with gradients, and examples/flax_moe_ep.py: expert parallelism over 4 of
the 8 forced host devices, its loss curve equal to the one-device layer's.

Each op's result must vary along the axes its operands vary along, or the transpose of a
product inside shard_map fails ("Expected cotangent type ...{V:axis} but got ...")."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_tma
from support import REPO, rel_error

sys.path.insert(0, str(REPO / "examples"))
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def mesh():
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest forces 8 host devices)")
    return Mesh(np.array(jax.devices()[:4]), ("x",))


def _grads_match(mesh, op, reference, args, specs, tol=2e-2):
    """Gradients of sum(op(*args)**2) computed per shard inside shard_map (operands varying
    along "x") against the reference op's, and the forward values."""
    def loss(fn):
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("x"))
        return lambda *a: jnp.sum(mapped(*a).astype(jnp.float32) ** 2)
    ours = jax.jit(jax.value_and_grad(loss(op), argnums=(0, 1)))(*args)
    ref = jax.jit(jax.value_and_grad(loss(reference), argnums=(0, 1)))(*args)
    assert rel_error(ours[0], ref[0]) <= tol
    for g, r in zip(ours[1], ref[1]):
        assert rel_error(g, r) <= tol


def test_ragged_dot_in_shard_map(mesh, rng):
    x = rng.standard_normal((4 * 96, 64)).astype(BF16)
    w = rng.standard_normal((4 * 3, 64, 32)).astype(BF16)  # 3 experts per shard
    gs = np.tile(np.array([40, 0, 50], np.int32), 4)  # 90 of 96 rows per shard
    _grads_match(mesh, jax_tma.ragged_dot, lax.ragged_dot, (x, w, gs),
                 (P("x"), P("x"), P("x")))


def test_dot_general_dense_and_fp8_in_shard_map(mesh, rng):
    x = rng.standard_normal((4 * 64, 128)).astype(BF16)
    w = rng.standard_normal((128, 96)).astype(BF16)
    specs = (P("x"), P())
    _grads_match(mesh, jax_tma.matmul, jnp.matmul, (x, w), specs)
    _grads_match(mesh, lambda a, b: jax_tma.dense(a, b, activation="gelu"),
                 lambda a, b: jax.nn.gelu(a @ b), (x, w), specs)

    _grads_match(mesh, lambda a, b: jax_tma.mlp(a, b, jnp.ones((96,), jnp.float32), b.T,
                                                jnp.zeros((128,), jnp.float32), "gelu", a),
                 lambda a, b: (jax.nn.gelu(a @ b + 1) @ b.T + a).astype(jnp.bfloat16), (x, w),
                 specs, tol=3e-2)

    def fp8(a, b):
        qa, sa = jax_tma.quantize_fp8(a.astype(jnp.float32), (1, 128))
        qb, sb = jax_tma.quantize_fp8(b.astype(jnp.float32).T, (128, 128))
        return jax_tma.fp8_dot_general(qa, qb, sa, sb, (((1,), (1,)), ((), ())))
    _grads_match(mesh, fp8, lambda a, b: (a @ b).astype(jnp.bfloat16), (x, w), specs, tol=6e-2)


def test_expert_parallel_example_matches_one_device(mesh, capsys):
    import flax_moe_ep  # noqa: PLC0415

    status = flax_moe_ep.main(["--devices", "4", "--steps", "12", "--tokens", "256",
                               "--d-model", "64", "--d-ff", "128", "--experts", "8"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "2 per device" in out and ": OK" in out
    diff = float(out.split("max relative difference of the loss curves: ")[1].split()[0])
    assert diff <= flax_moe_ep.flax_moe.TOLERANCE["bf16"]


def test_expert_parallel_example_rejects_bad_splits():
    import flax_moe_ep  # noqa: PLC0415

    with pytest.raises(SystemExit):
        flax_moe_ep.main(["--devices", "3", "--experts", "8"])
