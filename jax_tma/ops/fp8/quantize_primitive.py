"""The one-pass e4m3 block quantiser ``jax_tma_fp8_quantize`` (csrc/kernels/sm90_fp8_quantize.cu):
``quantize_fp8(x, (128, 128))`` of x [B, R, C] (or of two such arrays side by side along C) with
each block read once, its values written in x's layout and, where asked, transposed [B, C, R]
(the K-major form the FP8 kernels read of weights stored [K, N]). The MoE layer quantises its
FP8 experts' weights with it each step, where XLA reads them twice (a reduction for the block
maxima, then the values) and transposes the values in a third pass.

Results: (values [B, R, C] e4m3, values_t [B, C, R] e4m3 with ``with_transpose``, scales
[B, ceil(C / 128), ceil(R / 128)] fp32): quantize_fp8's (its XLA form is the reference off
Hopper), bit for bit as XLA computes it on the CPU. XLA's GPU division is not correctly
rounded: on an H200, arrays of 470M elements had values that differ from XLA's GPU
quantize_fp8 (not counted), where the kernel's division is IEEE's. vmap folds the mapped axis
into B; sharding keeps B's mesh axes, and R's and C's where each device holds whole 128-blocks
of them (others are gathered; the columns of two parts always are). JAX_TMA_FP8_KERNEL=0 turns
it off with the FP8 products (the XLA form runs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching
from jax.sharding import NamedSharding, PartitionSpec

from jax_tma._core.aval import result_aval
from jax_tma._core.primitive import bind_local, define_primitive, kernel_ffi_call
from jax_tma._core.sharding import AxisClaims, Params, one, partitioned_call, spec_of
from jax_tma.ops.fp8 import primitive as fp8_primitive
from jax_tma.ops.fp8.config import SCALE_BLOCK
from jax_tma.ops.fp8.quantize import _quantize_values
from jax_tma.ops.ragged.primitive import fold_vmapped

KERNEL_TARGET = "jax_tma_fp8_quantize_sm90"
_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
_INPUTS = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))
_MAX_ROW_BLOCKS = 65535  # the kernel's grid.y


def _blocks(n: int) -> int:
    return -(-n // SCALE_BLOCK)


def _abstract_eval(*parts, with_transpose, local):
    del local
    b, r, _ = parts[0].shape
    c = sum(p.shape[2] for p in parts)
    outs = [result_aval((b, r, c), _E4M3, *parts)]
    if with_transpose:
        outs.append(result_aval((b, c, r), _E4M3, *parts))
    outs.append(result_aval((b, _blocks(c), _blocks(r)), jnp.float32, *parts))
    return outs


def _reference(*parts, with_transpose, local):
    """quantize_fp8's XLA form of the parts side by side."""
    del local
    x = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)
    values, scales = _quantize_values(x, (SCALE_BLOCK, SCALE_BLOCK), _E4M3)
    return [values, jnp.swapaxes(values, 1, 2), scales] if with_transpose else [values, scales]


def _kernel_call(*parts, with_transpose: bool, poison: bool = False):
    """The kernel's results (the primitive's); with `poison`, the outputs come in NaN-filled
    (the tests' check that every element is written)."""
    b, r, _ = parts[0].shape
    c = sum(p.shape[2] for p in parts)
    second = parts[1] if len(parts) > 1 else jnp.zeros((1,), parts[0].dtype)
    out_types = (jax.ShapeDtypeStruct((b, r, c), _E4M3),
                 jax.ShapeDtypeStruct((b, c, r) if with_transpose else (1,), _E4M3),
                 jax.ShapeDtypeStruct((b, _blocks(c), _blocks(r)), jnp.float32))
    attrs = dict(with_transpose=np.int64(with_transpose), two_parts=np.int64(len(parts) > 1))
    values, values_t, scales = kernel_ffi_call(KERNEL_TARGET, out_types, (parts[0], second),
                                               attrs, poison=poison, poisoned=(0, 1, 2))
    return [values, values_t, scales] if with_transpose else [values, scales]


def kernel_applies(parts) -> bool:
    """Whether the kernel computes these parts (avals or arrays): 16- or 32-bit floats of one
    type, non-empty, at most 65535 blocks of rows, the first of two parts whole 128-column
    blocks."""
    b, r, _ = parts[0].shape
    return (all(jnp.dtype(p.dtype) == jnp.dtype(parts[0].dtype) for p in parts)
            and jnp.dtype(parts[0].dtype) in _INPUTS and b * r > 0
            and all(p.shape[2] > 0 for p in parts) and _blocks(r) <= _MAX_ROW_BLOCKS
            and (len(parts) == 1 or parts[0].shape[2] % SCALE_BLOCK == 0))


def _kernel_fn(avals_in, params):
    if not fp8_primitive.kernel_enabled() or not kernel_applies(avals_in):
        return None
    return functools.partial(_kernel_call, with_transpose=params["with_transpose"])


# --- Sharding ----------------------------------------------------------------------------------
def _choose(mesh, arg_shapes, with_transpose):
    """(operand shardings, result shardings): B keeps its mesh axes, R and C theirs where every
    device holds whole 128-blocks; C of two parts stays whole (a device's share of the parts
    side by side is not the parts' shares side by side)."""
    b, r, c = arg_shapes[0].shape
    spec = spec_of(arg_shapes[0].sharding, 3)
    claim = AxisClaims(mesh)
    b_axes = claim(spec[0], b)
    r_axes = claim(spec[1], r, SCALE_BLOCK)
    c_axes = claim(spec[2], c, SCALE_BLOCK) if len(arg_shapes) == 1 else ()
    part = NamedSharding(mesh, PartitionSpec(one(b_axes), one(r_axes), one(c_axes)))
    flipped = NamedSharding(mesh, PartitionSpec(one(b_axes), one(c_axes), one(r_axes)))
    results = [part, flipped, flipped] if with_transpose else [part, flipped]
    return (part,) * len(arg_shapes), results


def _infer(local_op, params, mesh, arg_shapes, result_shape):
    del local_op, result_shape
    return _choose(mesh, arg_shapes, params["with_transpose"])[1]


def _partition(local_op, params, mesh, arg_shapes, result_shape):
    del result_shape
    args, results = _choose(mesh, arg_shapes, params["with_transpose"])

    def per_device(*parts):
        return local_op(*parts, with_transpose=params["with_transpose"])

    return mesh, per_device, results, args


def _sharding_rule(local_op, params, mesh, operand_types, result_types):
    del local_op, mesh, result_types
    parts = ", ".join(f"b r c{i}" for i in range(len(operand_types)))
    if len(operand_types) > 1:  # the results' columns are all the parts': a factor of their own
        outs = ["b r n", "b n r", "b nb rb"]
    else:
        outs = ["b r c0", "b c0 r", "b nb rb"]
    if not params["with_transpose"]:
        outs.pop(1)
    return f"{parts} -> {', '.join(outs)}"


_partitioned_call = partitioned_call(partition=_partition, infer_sharding_from_operands=_infer,
                                     sharding_rule=_sharding_rule, num_static=2)


def _partitioned(params):
    static = Params.static(params)
    return functools.partial(_partitioned_call, bind_local(fp8_quantize_p), static)


def _batch_rule(args, dims, *, with_transpose, local):
    """vmap: the mapped axis joins B (an unmapped part is broadcast)."""
    folded, size, batch = fold_vmapped(args, dims, (False,) * len(args))
    outs = fp8_quantize_p.bind(*folded, with_transpose=with_transpose, local=local)
    return [o.reshape(size, batch, *o.shape[1:]) for o in outs], [0] * len(outs)


fp8_quantize_p = define_primitive("jax_tma_fp8_quantize", abstract_eval=_abstract_eval,
                                  reference=_reference, kernel_fn=_kernel_fn,
                                  partitioned=_partitioned, multiple_results=True)
batching.primitive_batchers[fp8_quantize_p] = _batch_rule


def quantize_blocks(*parts: jax.Array, with_transpose: bool = True):
    """``quantize_fp8(concatenate(parts, -1), (128, 128))`` of [..., R, C_i] float arrays (the
    leading dims shared) with the values also transposed: (values [..., R, C], values_t
    [..., C, R] where `with_transpose`, scales [..., ceil(C / 128), ceil(R / 128)]). Not
    differentiable (the MoE layer's custom_vjp differentiates around it)."""
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"jax_tma quantize_blocks: one or two parts, got {len(parts)}")
    parts = [jnp.asarray(p) for p in parts]
    lead, rows = parts[0].shape[:-2], parts[0].shape[-2]
    if any(p.ndim < 2 or p.shape[:-1] != parts[0].shape[:-1] for p in parts):
        raise ValueError("jax_tma quantize_blocks: the parts must be [..., R, C_i] with the same "
                         f"leading dims and R, got shapes {[p.shape for p in parts]}")
    if len(parts) == 2 and parts[0].shape[-1] % SCALE_BLOCK:
        parts = [jnp.concatenate(parts, axis=-1)]  # a block would span both parts
    dtype = jnp.result_type(*parts)
    flat = [p.astype(dtype).reshape(-1, rows, p.shape[-1]) for p in parts]
    outs = fp8_quantize_p.bind(*flat, with_transpose=bool(with_transpose), local=False)
    return tuple(o.reshape(*lead, *o.shape[1:]) for o in outs)
