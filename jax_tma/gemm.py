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
# TMA needs 16-byte global strides: K (row length of a) and the row length of b, which the
# lowering pads to this multiple when N is not one.
STRIDE_ELEMS = 8
BLOCK_K = 64
DEFAULT_NUM_SMS = 132
# (block_m, block_n, stages, cluster_m, has a direct-store variant) of the TileConfig
# instantiations in csrc/kernels/sm90_gemm.h.
_COMPILED_TILES = (
    (128, 256, 4, 2, False),
    (128, 256, 4, 1, False),
    (128, 128, 6, 2, False),
    (128, 128, 6, 1, True),
    (64, 128, 8, 1, True),
)
_TILE_KEYS = {t[:4]: t[4] for t in _COMPILED_TILES}
MAX_SPLIT_K = 16
# EpilogueKind (csrc/kernels/sm90_gemm.h).
_EPILOGUE_TMA_STORE, _EPILOGUE_DIRECT = 0, 1


def kernel_output_dtypes(in_dtype) -> tuple:
    """Output dtypes the kernel writes for inputs of `in_dtype`: the input type or fp32."""
    return (jnp.dtype(in_dtype), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One compiled configuration of the sm90 GEMM kernel.

    Attributes:
      block_m: rows of the CTA tile: 128 (two consumer warpgroups of 64 rows) or 64 (one).
      block_n: columns of the CTA tile.
      stages: depth of the TMA -> wgmma shared-memory ring (K slices of 64).
      cluster_m: CTAs per cluster along M. With 2, the CTAs of a cluster compute vertically
        adjacent tiles and multicast the shared B slice to each other.
      split_k: how many K ranges the product is split into (1: none). Each range writes an fp32
        partial product; the partial products are summed in a fixed order (deterministic).
        At most this many ranges are used, so that none is empty.
    """

    block_m: int = 128
    block_n: int = 256
    stages: int = 4
    cluster_m: int = 2
    split_k: int = 1

    def __post_init__(self) -> None:
        if self.tile not in _TILE_KEYS:
            choices = "; ".join(
                f"block_m={bm}, block_n={bn}, stages={st}, cluster_m={cm}"
                for bm, bn, st, cm, _ in _COMPILED_TILES
            )
            raise ValueError(
                f"jax_tma: GemmConfig({self.describe()}) is not a compiled configuration; "
                f"choose one of: {choices}"
            )
        if not (isinstance(self.split_k, int) and 1 <= self.split_k <= MAX_SPLIT_K):
            raise ValueError(
                f"jax_tma: GemmConfig split_k must be an int in [1, {MAX_SPLIT_K}], "
                f"got {self.split_k!r}"
            )

    @property
    def tile(self) -> tuple[int, int, int, int]:
        return (self.block_m, self.block_n, self.stages, self.cluster_m)

    @property
    def has_direct_store(self) -> bool:
        """Whether this tile is also compiled with the epilogue for unaligned output rows."""
        return _TILE_KEYS[self.tile]

    def splits_for(self, k: int) -> int:
        """K ranges actually used for a depth of k: at most split_k, none of them empty."""
        k_blocks = -(-k // BLOCK_K)
        per_split = -(-k_blocks // min(self.split_k, k_blocks))
        return -(-k_blocks // per_split)

    def describe(self) -> str:
        return (
            f"block_m={self.block_m}, block_n={self.block_n}, stages={self.stages}, "
            f"cluster_m={self.cluster_m}, split_k={self.split_k}"
        )


COMPILED_CONFIGS: tuple[GemmConfig, ...] = tuple(
    GemmConfig(bm, bn, st, cm) for bm, bn, st, cm, _ in _COMPILED_TILES
)


def tma_store_aligned(n: int, out_dtype) -> bool:
    """Whether rows of an [M, n] output are 16-byte multiples, as TMA stores need."""
    return (n * jnp.dtype(out_dtype).itemsize) % 16 == 0


def check_config(config: GemmConfig, m: int, n: int, k: int, out_dtype) -> None:
    """Raises ValueError when `config` cannot compute an M x N x K product into out_dtype."""
    # Split-K writes fp32 partial products; otherwise the kernel writes out_dtype.
    stored = jnp.float32 if config.splits_for(k) > 1 else out_dtype
    if not tma_store_aligned(n, stored) and not config.has_direct_store:
        itemsize = jnp.dtype(stored).itemsize
        raise ValueError(
            f"jax_tma: GemmConfig({config.describe()}) stores through TMA, which needs output "
            f"rows of a multiple of 16 bytes; a ({m}, {n}) output of {jnp.dtype(stored).name} "
            f"has {n * itemsize}-byte rows. Use a tile compiled with the direct-store epilogue "
            "(block_m=64, or block_m=128, block_n=128, cluster_m=1)"
        )


# Constants of the cost model, fitted to a sweep of every configuration on an H200
# (benchmarks/bench_gemm.py --sweep). Relative wgmma throughput of one CTA per tile shape: two
# consumer warpgroups on a wide tile keep the tensor cores busiest, one (block_m=64) far less.
_TILE_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.9, (64, 128): 0.4}
_PEAK_FLOPS_PER_SM = 989e12 / 132
# Streaming operands: about 40 GB/s per busy CTA, at most about 4 TB/s in all.
_MEMORY_BYTES_PER_S = 4.0e12
_MEMORY_BYTES_PER_S_PER_CTA = 40e9
_SPLIT_FIXED_S = 1e-6  # the extra reduction kernel
_SPLIT_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)


def estimate_seconds(config: GemmConfig, m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS,
                     out_bytes: int = 2) -> float:
    """Cost model behind default_config: waves of tiles times the time of one tile (its K
    range at the tile shape's wgmma efficiency), or the operands' memory traffic at the
    bandwidth the busy CTAs can pull if that takes longer, plus the split-K partial products'
    round trip through memory."""
    splits = config.splits_for(k)
    units = math.ceil(m / config.block_m) * math.ceil(n / config.block_n) * splits
    waves = math.ceil(units / num_sms)
    k_per_split = math.ceil(math.ceil(k / BLOCK_K) / splits) * BLOCK_K
    tile_s = (2 * config.block_m * config.block_n * k_per_split) / (
        _PEAK_FLOPS_PER_SM * _TILE_EFFICIENCY[(config.block_m, config.block_n)]
    )
    bandwidth = min(_MEMORY_BYTES_PER_S, min(units, num_sms) * _MEMORY_BYTES_PER_S_PER_CTA)
    memory_s = (2 * (m * k + k * n) + out_bytes * m * n) / bandwidth
    split_s = 0.0 if splits == 1 else _SPLIT_FIXED_S + 8 * splits * m * n / _MEMORY_BYTES_PER_S
    return max(waves * tile_s, memory_s) + split_s


def default_config(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS,
                   out_dtype=jnp.bfloat16) -> GemmConfig:
    """Picks a configuration for an M x N x K problem.

    Every compiled tile with every split-K choice is scored by ``estimate_seconds`` (waves,
    last-wave utilization and tile efficiency, or memory traffic for skinny problems); among
    equal scores the deeper pipeline wins, then the cluster of 2 (B multicast), which halves
    the L2 traffic of B whenever both CTAs of a cluster have a tile. Split-K runs without
    clusters: measured, the cluster's lockstep only slows its short K ranges down.
    """
    out_bytes = jnp.dtype(out_dtype).itemsize
    best, best_key = None, None
    for tile in COMPILED_CONFIGS:
        for split_k in _SPLIT_CHOICES:
            cfg = dataclasses.replace(tile, split_k=split_k)
            if split_k > 1 and (cfg.splits_for(k) != split_k or cfg.cluster_m > 1):
                continue
            try:
                check_config(cfg, m, n, k, out_dtype)
            except ValueError:
                continue
            multicast = cfg.cluster_m > 1 and math.ceil(m / cfg.block_m) >= cfg.cluster_m
            key = (
                round(estimate_seconds(cfg, m, n, k, num_sms, out_bytes), 9),
                -cfg.stages,
                -int(multicast),
                cfg.split_k,
            )
            if best_key is None or key < best_key:
                best, best_key = cfg, key
    return best


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


def _kernel_call(a, b, *, out_dtype, config, poison=False):
    """The FFI call: pads b's rows to a 16-byte multiple, runs the kernel, and sums split-K
    partial products. With `poison`, the kernel writes over NaN-filled buffers (tests)."""
    m, k = a.shape
    n = b.shape[1]
    pad = (-n) % STRIDE_ELEMS
    if pad:
        b = jnp.pad(b, ((0, 0), (0, pad)))
    cfg = config or default_config(m, n, k, _num_sms(), out_dtype)
    check_config(cfg, m, n, k, out_dtype)
    splits = cfg.splits_for(k)
    d_dtype = jnp.dtype(jnp.float32) if splits > 1 else jnp.dtype(out_dtype)
    d_shape = (splits, m, n) if splits > 1 else (m, n)
    aligned = tma_store_aligned(n, d_dtype)
    attrs = dict(
        block_m=np.int64(cfg.block_m),
        block_n=np.int64(cfg.block_n),
        stages=np.int64(cfg.stages),
        cluster_m=np.int64(cfg.cluster_m),
        epilogue=np.int64(_EPILOGUE_TMA_STORE if aligned else _EPILOGUE_DIRECT),
        splits=np.int64(splits),
    )
    out_type = jax.ShapeDtypeStruct(d_shape, d_dtype)
    if poison:
        d = jax.ffi.ffi_call(KERNEL_TARGET + "_into", out_type, input_output_aliases={2: 0})(
            a, b, jnp.full(d_shape, jnp.nan, d_dtype), **attrs
        )
    else:
        d = jax.ffi.ffi_call(KERNEL_TARGET, out_type)(a, b, **attrs)
    if splits > 1:
        d = jnp.sum(d, axis=0).astype(out_dtype)
    return d


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
    if jnp.dtype(out_dtype) not in kernel_output_dtypes(a_dtype):
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
    if config is not None:
        (m, k), n = np.shape(a), np.shape(b)[1]
        check_config(config, m, n, k, expected.dtype)
    return gemm_p.bind(jnp.asarray(a), jnp.asarray(b), out_dtype=expected.dtype, config=config)
