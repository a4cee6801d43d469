"""jax_tma.dot_general inside Flax layers: linen ``Dense`` / ``DenseGeneral`` and nnx ``Linear`` /
``LinearGeneral`` built with ``dot_general=jax_tma.dot_general`` give the outputs and gradients
of the same layers built with the default ``lax.dot_general``, and examples/flax_mlp.py trains
to the same loss curve either way.

Error bounds (Frobenius-norm relative error against a float64 einsum of the same rounded
operands, on random data): by result dtype, float32 1e-5 (float32 layers run with
``precision=HIGHEST``, so no TF32 on GPUs), bfloat16 1e-2, float16 2e-3; the two layers are
held to the same bound against each other. Loss curves: ``flax_mlp.TOLERANCE``.

Tests marked ``gpu`` also count the jax_tma custom calls in the compiled HLO; the CUDA lowering
tests count them in a cross-lowering on the CPU (they need the extension, not a GPU).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jax_tma
from support import REPO, needs_extension, random_array, rel_error

sys.path.insert(0, str(REPO / "examples"))
import flax_mlp  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
TOL = {F32: 1e-5, BF16: 1e-2, F16: 2e-3}
_LOWERED_CALL = re.compile(r"stablehlo\.custom_call @(jax_tma_\w+)\(")


# ---------------------------------------------------------------- layers under test


@dataclasses.dataclass(frozen=True)
class Case:
    """A layer with a kernel and a bias, applied to x of ``x_shape``.

    ``spec`` is the einsum of the product ("x,kernel->y"); ``bias`` the subscripts of the bias,
    a subset of y's. ``make(dot_general, dtype)`` builds the layer and returns
    ``(apply(kernel, bias, x) -> y, kernel shape, bias shape)``.
    """

    name: str
    make: Callable
    x_shape: tuple[int, ...]
    spec: str
    bias: str


def _linen(cls, **kw):
    def make(dot_general, dtype, x_shape):
        precision = jax.lax.Precision.HIGHEST if dtype == F32 else None
        module = cls(**kw, dtype=dtype, param_dtype=dtype, precision=precision,
                     dot_general=dot_general)
        x_spec = jax.ShapeDtypeStruct(x_shape, dtype)
        shapes = jax.eval_shape(module.init, jax.random.key(0), x_spec)["params"]

        def apply(kernel, bias, x):
            return module.apply({"params": {"kernel": kernel, "bias": bias}}, x)

        return apply, shapes["kernel"].shape, shapes["bias"].shape

    return make


def _nnx(cls, *args, **kw):
    def make(dot_general, dtype, x_shape):
        del x_shape
        precision = jax.lax.Precision.HIGHEST if dtype == F32 else None
        module = cls(*args, **kw, dtype=dtype, param_dtype=dtype, precision=precision,
                     dot_general=dot_general, rngs=nnx.Rngs(0))
        return _nnx_functional(module)

    return make


def _nnx_functional(module):
    """(apply(kernel, bias, x), kernel shape, bias shape) of an nnx layer."""
    graphdef, state = nnx.split(module)
    shapes = {("kernel" if "kernel" in jax.tree_util.keystr(path) else "bias"): np.shape(leaf)
              for path, leaf in jax.tree_util.tree_leaves_with_path(state)}

    def apply(kernel, bias, x):
        params = nnx.State({"kernel": nnx.Param(kernel), "bias": nnx.Param(bias)})
        return nnx.merge(graphdef, params)(x)

    return apply, shapes["kernel"], shapes["bias"]


CASES = [
    Case("linen.Dense", _linen(nn.Dense, features=48), (32, 64), "bi,io->bo", "o"),
    Case("linen.Dense-3d", _linen(nn.Dense, features=24), (4, 8, 64), "bsi,io->bso", "o"),
    Case("linen.DenseGeneral-trailing-axes",
         _linen(nn.DenseGeneral, features=(4, 8), axis=(-2, -1)),
         (16, 8, 16), "bij,ijfg->bfg", "fg"),
    Case("linen.DenseGeneral-split-axes", _linen(nn.DenseGeneral, features=(4, 6), axis=(1, -1)),
         (2, 3, 5, 8), "bixj,ijfg->bxfg", "fg"),
    Case("linen.DenseGeneral-batch-dims",
         _linen(nn.DenseGeneral, features=16, axis=-1, batch_dims=(0,)),
         (4, 8, 32), "bsi,bif->bsf", "bf"),
    Case("nnx.Linear", _nnx(nnx.Linear, 64, 48), (32, 64), "bi,io->bo", "o"),
    Case("nnx.Linear-3d", _nnx(nnx.Linear, 64, 24), (4, 8, 64), "bsi,io->bso", "o"),
    Case("nnx.LinearGeneral-trailing-axes",
         _nnx(nnx.LinearGeneral, (8, 16), (4, 8), axis=(-2, -1)),
         (16, 8, 16), "bij,ijfg->bfg", "fg"),
    Case("nnx.LinearGeneral-split-axes", _nnx(nnx.LinearGeneral, (3, 8), (4, 6), axis=(1, -1)),
         (2, 3, 5, 8), "bixj,ijfg->bxfg", "fg"),
    Case("nnx.LinearGeneral-batch-axis",
         _nnx(nnx.LinearGeneral, 32, 16, axis=-1, batch_axis={0: 4}),
         (4, 8, 32), "bsi,bif->bsf", "bf"),
]


def _vjp_fn(apply):
    """(kernel, bias, x, cotangent) -> (y, d kernel, d bias, d x): forward and both products of
    the backward pass."""

    def fn(kernel, bias, x, g):
        y, pullback = jax.vjp(apply, kernel, bias, x)
        return (y, *pullback(g))

    return fn


def _operands(case: Case, dtype, rng, kernel_shape, bias_shape, out_dtype=None):
    kernel = random_array(rng, kernel_shape, dtype)
    bias = random_array(rng, bias_shape, dtype)
    x = random_array(rng, case.x_shape, dtype)
    xs, rest = case.spec.split(",")
    ks, ys = rest.split("->")
    sizes = {**dict(zip(xs, case.x_shape)), **dict(zip(ks, kernel_shape))}
    y_shape = tuple(sizes[c] for c in ys)
    g = random_array(rng, y_shape, out_dtype or dtype)
    return kernel, bias, x, g


def _reference(case: Case, kernel, bias, x, g):
    """float64 (y, d kernel, d bias, d x) of y = einsum(x, kernel) + bias."""
    xs, rest = case.spec.split(",")
    ks, ys = rest.split("->")
    k64, b64, x64, g64 = (np.asarray(v, np.float64) for v in (kernel, bias, x, g))
    bias_view = np.einsum(f"{case.bias}->{''.join(c if c in case.bias else '' for c in ys)}", b64)
    shape = [y_dim if c in case.bias else 1 for c, y_dim in zip(ys, g64.shape)]
    y = np.einsum(case.spec, x64, k64) + bias_view.reshape(shape)
    dk = np.einsum(f"{xs},{ys}->{ks}", x64, g64)
    db = np.einsum(f"{ys}->{case.bias}", g64)
    dx = np.einsum(f"{ys},{ks}->{xs}", g64, k64)
    return y, dk, db, dx


def _check(results, ref, label):
    for name, got, want in zip(("y", "d kernel", "d bias", "d x"), results, ref):
        tol = TOL[np.dtype(got.dtype)]
        if name == "d bias" and np.dtype(got.dtype).itemsize == 2:
            # A sum over the batch that XLA reduces in the layer's 16-bit dtype (no product:
            # the same computation with either dot_general); measured up to 1.1e-2 in bf16.
            tol *= 2
        err = rel_error(got, want)
        assert err <= tol, f"{label} {name} ({got.dtype}): rel. error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_layer_matches_default(case, dtype, rng):
    apply_tma, kernel_shape, bias_shape = case.make(jax_tma.dot_general, dtype, case.x_shape)
    apply_xla, *shapes_xla = case.make(jax.lax.dot_general, dtype, case.x_shape)
    assert [kernel_shape, bias_shape] == shapes_xla
    operands = _operands(case, dtype, rng, kernel_shape, bias_shape)
    ours = jax.jit(_vjp_fn(apply_tma))(*operands)
    default = jax.jit(_vjp_fn(apply_xla))(*operands)
    for a, b in zip(ours, default):
        assert a.shape == b.shape and a.dtype == b.dtype
    ref = _reference(case, *operands)
    _check(ours, ref, f"{case.name} jax_tma")
    _check(default, ref, f"{case.name} default")
    _check(ours, default, f"{case.name} jax_tma vs default")


def _nnx_linear_f32_out(dot_general, dtype, x_shape):
    """nnx.Linear with 16-bit operands and a float32 result (preferred_element_type)."""
    del x_shape
    return _nnx_functional(nnx.Linear(64, 48, dtype=dtype, param_dtype=dtype,
                                      dot_general=dot_general,
                                      preferred_element_type=jnp.float32, rngs=nnx.Rngs(0)))


F32_OUT = Case("nnx.Linear-f32-out", _nnx_linear_f32_out, (32, 64), "bi,io->bo", "o")


def test_preferred_element_type_float32(rng):
    apply_tma, kernel_shape, bias_shape = F32_OUT.make(jax_tma.dot_general, BF16, F32_OUT.x_shape)
    apply_xla, _, _ = F32_OUT.make(jax.lax.dot_general, BF16, F32_OUT.x_shape)
    operands = _operands(F32_OUT, BF16, rng, kernel_shape, bias_shape, out_dtype=F32)
    ours = jax.jit(_vjp_fn(apply_tma))(*operands)
    default = jax.jit(_vjp_fn(apply_xla))(*operands)
    assert ours[0].dtype == default[0].dtype == F32
    assert [v.dtype for v in ours] == [v.dtype for v in default]
    ref = _reference(F32_OUT, *operands)
    _check(ours, ref, "jax_tma")
    _check(ours, default, "jax_tma vs default")


# ---------------------------------------------------------------- the example's training run


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_example_curve_matches_xla(dtype):
    kw = dict(batch=64, hidden=64, depth=2, dtype=dtype, seed=1, learning_rate=3e-3)
    ours = flax_mlp.train(30, use_tma=True, **kw)
    default = flax_mlp.train(30, use_tma=False, **kw)
    assert len(ours) == len(default) == 30
    assert np.all(np.isfinite(ours)) and ours[-1] < 0.7 * ours[0], ours  # it learns
    diff = flax_mlp.max_relative_difference(ours, default)
    assert diff <= flax_mlp.TOLERANCE[dtype], f"loss curves differ by {diff:.2e}"


def test_example_data_parallel_cli():
    """The command line, with the batch sharded over 2 (forced host) devices."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "flax_mlp.py"), "--steps", "20", "--batch", "64",
         "--hidden", "64", "--devices", "2"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "x 2 |" in result.stdout and "max relative difference" in result.stdout
    assert "OK" in result.stdout


def test_example_rejects_batch_not_divisible():
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "flax_mlp.py"), "--batch", "63", "--devices", "2"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 2 and "multiple of --devices" in result.stderr


# ---------------------------------------------------------------- which path runs


def _specs(*arrays):
    return [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in arrays]


def _cuda_kernel_calls(fn, *args) -> int:
    """jax_tma custom calls in fn lowered for CUDA (works without a GPU)."""
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return len(_LOWERED_CALL.findall(lowered.as_text()))


def _check_calls(case: Case, calls: int) -> None:
    """Forward, input gradient and weight gradient each run the kernel, except where the
    contracted axes of x are not adjacent (split-axes): there some products go through XLA."""
    if "split-axes" in case.name:
        assert 1 <= calls <= 3, calls
    else:
        assert calls == 3, calls


@needs_extension
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cuda_lowering_layer_backward(case, dtype, rng):
    apply, kernel_shape, bias_shape = case.make(jax_tma.dot_general, dtype, case.x_shape)
    operands = _operands(case, dtype, rng, kernel_shape, bias_shape)
    _check_calls(case, _cuda_kernel_calls(_vjp_fn(apply), *_specs(*operands)))


@needs_extension
def test_cuda_lowering_training_step():
    s = flax_mlp.setup(batch=64, hidden=64, depth=2, dtype="bf16", use_tma=True)
    args = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                        (s.params, s.opt_state, *s.batches[0]))
    assert _cuda_kernel_calls(s.step, *args) == flax_mlp.expected_kernel_calls(2)
    xla = flax_mlp.setup(batch=64, hidden=64, depth=2, dtype="bf16", use_tma=False)
    assert _cuda_kernel_calls(xla.step, *args) == 0


DENSE_CASES = [c for c in CASES if "General" not in c.name]  # linen and nnx, 2-D and 3-D x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", DENSE_CASES, ids=[c.name for c in DENSE_CASES])
def test_gpu_dense_backward_runs_kernel(case, dtype, rng):
    apply_tma, kernel_shape, bias_shape = case.make(jax_tma.dot_general, dtype, case.x_shape)
    apply_xla, _, _ = case.make(jax.lax.dot_general, dtype, case.x_shape)
    operands = _operands(case, dtype, rng, kernel_shape, bias_shape)
    assert flax_mlp.kernel_calls(_vjp_fn(apply_tma), *operands) == 3  # y, d kernel, d x
    assert flax_mlp.kernel_calls(_vjp_fn(apply_xla), *operands) == 0
    ours = jax.jit(_vjp_fn(apply_tma))(*operands)
    ref = _reference(case, *operands)
    _check(ours, ref, case.name)
    _check(ours, jax.jit(_vjp_fn(apply_xla))(*operands), f"{case.name} vs default")


GENERAL_CASES = [c for c in CASES if "General" in c.name]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GENERAL_CASES, ids=[c.name for c in GENERAL_CASES])
def test_gpu_general_layers_run_kernel(case, rng):
    apply, kernel_shape, bias_shape = case.make(jax_tma.dot_general, BF16, case.x_shape)
    operands = _operands(case, BF16, rng, kernel_shape, bias_shape)
    _check_calls(case, flax_mlp.kernel_calls(_vjp_fn(apply), *operands))
    _check(jax.jit(_vjp_fn(apply))(*operands), _reference(case, *operands), case.name)


@pytest.mark.gpu
def test_gpu_training_step_runs_kernel():
    depth = 2
    ours = flax_mlp.setup(batch=128, hidden=256, depth=depth, dtype="bf16", use_tma=True)
    default = flax_mlp.setup(batch=128, hidden=256, depth=depth, dtype="bf16", use_tma=False)
    args = (ours.params, ours.opt_state, *ours.batches[0])
    assert flax_mlp.kernel_calls(ours.step, *args) == flax_mlp.expected_kernel_calls(depth)
    assert flax_mlp.kernel_calls(default.step, *args) == 0
    diff = flax_mlp.max_relative_difference(flax_mlp.run(ours, 30), flax_mlp.run(default, 30))
    assert diff <= flax_mlp.TOLERANCE["bf16"], f"loss curves differ by {diff:.2e}"
