"""GEMM on Hopper: ``jax_tma.matmul`` and the primitive behind it.

``matmul(a, b)`` computes ``a @ b`` with the same result dtype, shape and errors as
``jnp.matmul``. 2-D bf16 or fp16 operands of one dtype, with K a multiple of 8, bind the
``jax_tma_gemm`` primitive; everything else goes straight to ``jnp.matmul``. The primitive
lowers to XLA's dot on every platform, and on CUDA to the ``jax_tma_gemm_sm90`` FFI kernel
(TMA loads into 128B-swizzled shared memory, an mbarrier pipeline, wgmma with fp32
accumulation) when the kernel can run there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_tma import _ext

KERNEL_TARGET = "jax_tma_gemm_sm90"
KERNEL_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
KERNEL_OUTPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# TMA needs 16-byte global strides: K (row length of a) and the row length of b, which the
# lowering pads to this multiple when N is not one.
STRIDE_ELEMS = 8
DEFAULT_NUM_SMS = 132
# (block_m, block_n, block_k, stages) of the TileConfig instantiations in
# csrc/kernels/sm90_gemm.h.
_COMPILED_TILES = ((128, 128, 64, 6), (128, 256, 64, 4))


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One compiled tile configuration of the sm90 GEMM kernel.

    Attributes:
      block_m: rows of the output tile (two consumer warpgroups of 64 rows).
      block_n: columns of the output tile.
      block_k: K slice per pipeline stage (one 128-byte swizzle row of 16-bit elements).
      stages: depth of the TMA -> wgmma shared-memory ring.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 4

    def __post_init__(self) -> None:
        if dataclasses.astuple(self) not in _COMPILED_TILES:
            choices = "; ".join(
                "block_m={}, block_n={}, block_k={}, stages={}".format(*t) for t in _COMPILED_TILES
            )
            raise ValueError(
                f"jax_tma: GemmConfig({self.describe()}) is not a compiled configuration; "
                f"choose one of: {choices}"
            )

    def describe(self) -> str:
        return (
            f"block_m={self.block_m}, block_n={self.block_n}, block_k={self.block_k}, "
            f"stages={self.stages}"
        )


COMPILED_CONFIGS: tuple[GemmConfig, ...] = tuple(GemmConfig(*t) for t in _COMPILED_TILES)


def default_config(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS) -> GemmConfig:
    """Picks a tile configuration for an M x N x K problem.

    Wide tiles (128 x 256) move the least data per FLOP; they are used when they still give
    every SM at least one tile, otherwise 128 x 128 tiles spread the work wider.
    """
    del k  # every configuration streams K the same way
    wide = COMPILED_CONFIGS[1]
    tiles_wide = math.ceil(m / wide.block_m) * math.ceil(n / wide.block_n)
    if n > COMPILED_CONFIGS[0].block_n and tiles_wide >= num_sms:
        return wide
    return COMPILED_CONFIGS[0]


def _num_sms() -> int:
    devices = _ext.cuda_devices()
    return int(getattr(devices[0], "core_count", DEFAULT_NUM_SMS)) if devices else DEFAULT_NUM_SMS


# --------------------------------------------------------------------------------------
# The primitive: a[M, K] @ b[K, N] -> [M, N] of out_dtype.

gemm_p = Primitive("jax_tma_gemm")


def _gemm_abstract_eval(a, b, *, out_dtype, config):
    del config
    return jax.core.ShapedArray((a.shape[0], b.shape[1]), out_dtype)


def _reference(a, b, *, out_dtype, config):
    del config
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)


@functools.cache
def _jitted_bind(out_dtype, config):
    return jax.jit(functools.partial(gemm_p.bind, out_dtype=out_dtype, config=config))


def _gemm_impl(a, b, *, out_dtype, config):
    return _jitted_bind(out_dtype, config)(a, b)


def _kernel_call(a, b, *, out_dtype, config, target=KERNEL_TARGET, into=None):
    """The FFI call: pads b's rows to a 16-byte multiple, runs the kernel on [M, N]."""
    m, n = a.shape[0], b.shape[1]
    pad = (-n) % STRIDE_ELEMS
    if pad:
        b = jnp.pad(b, ((0, 0), (0, pad)))
    cfg = config or default_config(m, n, a.shape[1], _num_sms())
    out_type = jax.ShapeDtypeStruct((m, n), out_dtype)
    attrs = dict(block_n=np.int64(cfg.block_n), stages=np.int64(cfg.stages))
    if into is None:
        return jax.ffi.ffi_call(target, out_type)(a, b, **attrs)
    return jax.ffi.ffi_call(target, out_type, input_output_aliases={2: 0})(a, b, into, **attrs)


def _gemm_lowering_cuda(ctx, a, b, *, out_dtype, config):
    if _ext.cuda_lowering_blocker() is not None:
        return mlir.lower_fun(
            functools.partial(_reference, out_dtype=out_dtype, config=config),
            multiple_results=False,
        )(ctx, a, b)
    return mlir.lower_fun(
        functools.partial(_kernel_call, out_dtype=out_dtype, config=config),
        multiple_results=False,
    )(ctx, a, b)


gemm_p.def_impl(_gemm_impl)
gemm_p.def_abstract_eval(_gemm_abstract_eval)
mlir.register_lowering(gemm_p, mlir.lower_fun(_reference, multiple_results=False))
mlir.register_lowering(gemm_p, _gemm_lowering_cuda, platform="cuda")


# --------------------------------------------------------------------------------------
# Public op.


def kernel_eligible(a: Any, b: Any, out_dtype: Any) -> bool:
    """True when (a, b, out_dtype) has the shapes and dtypes the sm90 kernel computes.

    Where it runs is decided when the primitive is lowered (platform, GPU, JAX_TMA_DISABLE).
    """
    if np.ndim(a) != 2 or np.ndim(b) != 2:
        return False
    a_dtype, b_dtype = jnp.result_type(a), jnp.result_type(b)
    if a_dtype != b_dtype or a_dtype not in KERNEL_INPUT_DTYPES:
        return False
    if jnp.dtype(out_dtype) not in KERNEL_OUTPUT_DTYPES:
        return False
    (m, k), (k_b, n) = np.shape(a), np.shape(b)
    return k == k_b and min(m, n, k) >= 1 and k % STRIDE_ELEMS == 0


def matmul(a: Any, b: Any, *, out_dtype: Any = None, config: GemmConfig | None = None) -> jax.Array:
    """Matrix product with ``jnp.matmul`` semantics, on the Hopper TMA kernel where it applies.

    Args:
      a: array of shape [..., M, K] or [K] (any dtype ``jnp.matmul`` accepts).
      b: array of shape [..., K, N] or [K].
      out_dtype: result dtype, as ``preferred_element_type`` of ``jnp.matmul``; by default the
        promoted input dtype.
      config: a ``GemmConfig`` to force a kernel tile configuration; by default a heuristic
        picks one. Ignored where the kernel does not apply.

    Returns:
      ``jnp.matmul(a, b, preferred_element_type=out_dtype)``, computed by the kernel (fp32
      accumulation) for 2-D bf16/fp16 operands with K % 8 == 0 on a Hopper GPU, otherwise by
      XLA. Errors are ``jnp.matmul``'s.
    """
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"jax_tma.matmul: config must be a GemmConfig or None, got {config!r}")
    expected = jax.eval_shape(
        functools.partial(jnp.matmul, preferred_element_type=out_dtype), a, b
    )
    _ext.warn_if_unavailable()
    if not kernel_eligible(a, b, expected.dtype):
        return jnp.matmul(a, b, preferred_element_type=out_dtype)
    return gemm_p.bind(jnp.asarray(a), jnp.asarray(b), out_dtype=expected.dtype, config=config)
