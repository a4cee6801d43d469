"""The one-pass e4m3 block quantiser (jax_tma/ops/fp8/quantize_primitive.py): its XLA form
against quantize_fp8 on the CPU (vmap and sharding too), the kernel on the GPU against a numpy
reference (float32 IEEE division, ml_dtypes' rounding to e4m3) with poisoned outputs. Not the
kernel against quantize_fp8 on the GPU: XLA's GPU division is not correctly rounded, and some
values of large arrays differ (docs/notebook/2026-11-30-layer-defaults-and-dw-peers.md)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_tma
from jax_tma.ops.fp8 import quantize_primitive as qp
from support import cpu_mesh, cuda_hlo, needs_extension, target_calls

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
E4M3 = jnp.float8_e4m3fn


def _public(parts):
    """quantize_fp8's (values, values transposed, scales) of the parts side by side."""
    x = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    values, scales = jax_tma.quantize_fp8(x, (128, 128))
    return values, jnp.swapaxes(values, -1, -2), scales


def _numpy(parts):
    """The same from numpy: block maxima, scale = amax * RN(1 / 448) (1 for a zero block: XLA
    turns the division by the constant 448 into that product) in float32, values = x / scale
    in float32, clamped to +-448, rounded by ml_dtypes."""
    x = np.concatenate([np.asarray(p, np.float32) for p in parts], axis=-1)
    b, r, c = x.shape
    rb, cb = -(-r // 128), -(-c // 128)
    padded = np.zeros((b, rb * 128, cb * 128), np.float32)
    padded[:, :r, :c] = x
    blocks = np.abs(padded.reshape(b, rb, 128, cb, 128))
    amax = blocks.max(axis=(2, 4))                                          # [B, Rb, Cb]
    scale = np.where(amax > 0, amax * (np.float32(1) / np.float32(448)),
                     np.float32(1)).astype(np.float32)
    full = np.repeat(np.repeat(scale, 128, axis=1), 128, axis=2)[:, :r, :c]
    q = np.clip(x / full, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, np.swapaxes(q, 1, 2), np.swapaxes(scale, 1, 2)


def _bits(a):
    return np.asarray(a).view(np.uint8) if np.asarray(a).dtype.itemsize == 1 else np.asarray(a)


def _assert_same(got, want):
    for g, w, name in zip(got, want, ("values", "values_t", "scales")):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)


CASES = {  # (part shapes, dtype)
    "one": ([(2, 256, 384)], F32),
    "ragged_edges": ([(3, 200, 300)], BF16),
    "narrow": ([(1, 130, 6)], F16),
    "two_parts": ([(2, 256, 256), (2, 256, 72)], F32),
    "two_parts_concatenated": ([(2, 64, 100), (2, 64, 28)], BF16),
}


def _parts(rng, shapes, dtype):
    return [jnp.asarray(rng.standard_normal(s).astype(np.float32) * 3, dtype) for s in shapes]


def _on_cpu():
    return jax.default_device(jax.devices("cpu")[0])


@pytest.mark.parametrize("case", list(CASES))
def test_matches_quantize_fp8(case, rng):
    shapes, dtype = CASES[case]
    with _on_cpu():
        parts = _parts(rng, shapes, dtype)
        _assert_same(jax.jit(qp.quantize_blocks)(*parts), _public(parts))
        values, scales = qp.quantize_blocks(*parts, with_transpose=False)
        _assert_same((values, scales), _public(parts)[::2])
        _assert_same(_public(parts), _numpy(parts))  # the GPU tests' reference


def test_vmap_and_leading_dims(rng):
    with _on_cpu():
        x = jnp.asarray(rng.standard_normal((2, 3, 130, 260)).astype(np.float32))
        got = jax.jit(jax.vmap(qp.quantize_blocks))(x)
        _assert_same(got, _public([x]))
        _assert_same(qp.quantize_blocks(x), _public([x]))  # [2, 3] folded into B


@pytest.mark.parametrize("spec", [P("a", None, "b"), P("a", "b", None), P(None, None, ("a", "b"))],
                         ids=["batch_cols", "batch_rows", "cols"])
@pytest.mark.parametrize("two", [False, True], ids=["one", "two"])
def test_sharded_matches(spec, two, rng):
    mesh = cpu_mesh((2, 2), ("a", "b"))
    parts = _parts(rng, [(4, 256, 512)] + ([(4, 256, 256)] if two else []), F32)
    placed = [jax.device_put(p, NamedSharding(mesh, spec)) for p in parts]
    with _on_cpu():
        _assert_same(jax.jit(qp.quantize_blocks)(*placed), _public(parts))


def test_bad_parts():
    x = jnp.zeros((2, 128, 128), F32)
    with pytest.raises(ValueError, match="one or two parts"):
        qp.quantize_blocks(x, x, x)
    with pytest.raises(ValueError, match=r"\(2, 128, 128\).*\(2, 64, 128\)"):
        qp.quantize_blocks(x, jnp.zeros((2, 64, 128), F32))


@needs_extension
def test_cuda_lowering_calls_the_kernel():
    spec = jax.ShapeDtypeStruct((4, 256, 512), F32)
    assert target_calls(cuda_hlo(qp.quantize_blocks, spec), qp.KERNEL_TARGET) == 1
    assert target_calls(cuda_hlo(lambda a, b: qp.quantize_blocks(a, b), spec, spec),
                        qp.KERNEL_TARGET) == 1


# ---------------------------------------------------------------- on the GPU
def _kernel(parts, with_transpose=True):
    fn = jax.jit(functools.partial(qp._kernel_call, with_transpose=with_transpose, poison=True))
    return fn(*parts)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_kernel_matches_numpy(case, rng):
    shapes, dtype = CASES[case]
    parts = _parts(rng, shapes, dtype)
    if len(parts) == 2 and shapes[0][-1] % 128:
        parts = [jnp.concatenate(parts, axis=-1)]  # as quantize_blocks hands it over
    got = _kernel(parts)
    assert not any(np.isnan(np.asarray(g, np.float32)).any() for g in got), "poison left"
    _assert_same(got, _numpy(parts))
    values, scales = _kernel(parts, with_transpose=False)
    _assert_same((values, scales), _numpy(parts)[::2])


@pytest.mark.gpu
def test_gpu_special_blocks():
    """A block of zeros has scale 1 and zero values; a block holding a NaN has scale 1 (the XLA
    form's maximum propagates the NaN, which fails its amax > 0) and keeps the NaN; an infinite
    block maximum gives an infinite scale; the other blocks are the numpy reference's."""
    x = np.ones((1, 256, 384), np.float32)
    x[0, :128, :128] = 0
    x[0, 5, 130] = np.nan
    x[0, 200, 10] = np.inf
    x[0, 130:256, 260:384] = np.linspace(-1, 1, 126 * 124).reshape(126, 124)
    values, values_t, scales = _kernel([jnp.asarray(x)])
    s = np.asarray(scales)[0]                                               # [Cb, Rb]
    v = np.asarray(values, np.float32)[0]
    assert s[0, 0] == 1 and not v[:128, :128].any()
    assert s[1, 0] == 1 and np.isnan(v[5, 130]) and v[6, 130] == 1
    assert np.isinf(s[0, 1])
    np.testing.assert_array_equal(_bits(values_t), _bits(np.swapaxes(np.asarray(values), 1, 2)))
    finite = np.isfinite(x)
    finite[0, 128:256, :128] = False  # the infinite block
    finite[0, :128, 128:256] = False  # the NaN block
    want = _numpy([jnp.asarray(np.where(finite, x, 0))])[0]
    np.testing.assert_array_equal(_bits(values)[finite], _bits(want)[finite])


@pytest.mark.gpu
def test_gpu_moe_weights_use_the_kernel(rng):
    """The FP8 MoE layer's step quantises its weights with the kernel (one call for the gate and
    up weights side by side, one for the down weights)."""
    import jax_tma.ops.moe.api as moe_api  # noqa: PLC0415
    wg, wu = (jnp.asarray(rng.standard_normal((4, 256, 256)).astype(np.float32)) for _ in "gu")
    compiled = jax.jit(moe_api._fp8_weights).lower((wg, wu)).compile().as_text()
    assert target_calls(compiled, qp.KERNEL_TARGET) == 1
    _assert_same(jax.jit(moe_api._fp8_weights)((wg, wu)), _numpy([wg, wu]))
