"""jax_tma: Hopper (sm_90a) kernels built on the Tensor Memory Accelerator, for JAX.

Importing the package registers the kernels' XLA FFI targets for the CUDA platform.

Public API:
  dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
    out_sharding=None): ``lax.dot_general`` on the TMA/wgmma kernel, with jvp, transpose,
    vmap and sharding rules (a drop-in ``dot_general=`` for Flax layers).
  matmul(a, b, *, precision=None, preferred_element_type=None, out_sharding=None,
    out_dtype=None, config=None): ``jnp.matmul`` on the same kernel.
  dense(x, w, bias, activation, residual), gated_dense(x, w_gate, w_up, activation),
    mlp(x, w1, b1, w2, b2, activation, residual), gated_mlp(x, w_gate, w_up, w_down,
    activation, residual): dense layers and MLP blocks with the bias, activation, residual or
    gating fused into the GEMM epilogue, with their gradients (also fused).
  ragged_dot(lhs, rhs, group_sizes, ...), ragged_dot_general(...): ``lax.ragged_dot`` and
    ``lax.ragged_dot_general`` on the grouped (MoE) kernel, group sizes read on the device.
  gated_ragged_dot(x, w_gate, w_up, group_sizes, activation): ``act(ragged_dot(x, w_gate)) *
    ragged_dot(x, w_up)`` (the SwiGLU / GeGLU experts' first half) in one grouped kernel with
    the gated epilogue, with its gradients.
  gated_ragged_mlp(x, w_gate, w_up, w_down, group_sizes, activation): every expert's gated MLP
    (gated_ragged_dot, then ragged_dot by w_down) whose backward writes the gate's and the up's
    cotangents from the epilogue of dy @ w_down^T.
  moe_mlp(x, router_kernel, w_up, w_down, w_gate, top_k=...): a Mixture-of-Experts MLP (routing,
    sorting by expert, the experts on the grouped kernel, combine; expert parallelism over a
    mesh axis), returning the output and the router's MoeStats.
  quantize_fp8(x, block, dtype), fp8_matmul(a, b, a_scale, b_scale),
    fp8_dot_general(lhs, rhs, lhs_scale, rhs_scale, dimension_numbers): FP8 (e4m3/e5m2)
    products with per-tensor, row/column or block (1x128, 128x128) scales on the FP8 kernel.
  fp8_ragged_dot(lhs, rhs, lhs_scale, rhs_scale, group_sizes): the block-scaled FP8 grouped
    (MoE) product, ``lax.ragged_dot`` of the dequantised operands (weights [G, N, K]) on one
    grouped FP8 kernel, group sizes read on the device; gradients as DeepSeek-V3 (dx in FP8,
    dW in bf16).
  GemmConfig: a compiled tile configuration to pass as ``config=``.
  kernel_status(): whether the kernels run on the default backend, and why not.
  autotune(lhs, rhs, dimension_numbers): times every configuration of a product on the device
    and caches the fastest for the kernel's later lowerings (JAX_TMA_AUTOTUNE=1: at trace time).
  fp8_autotune(lhs, rhs, lhs_scale, rhs_scale, dimension_numbers): the same for the FP8 kernel.
  export_disabled_checks(): what ``jax.export`` needs to serialize the kernels' custom calls.
  flax: Flax layers on the fused kernels (``jax_tma.flax``, imported on first use; needs flax).

Layout: jax_tma/_core (what every op is built on), jax_tma/ops/<op> (one package per op).
"""

import importlib

from jax_tma._export import export_disabled_checks
from jax_tma._ext import KernelStatus, kernel_status
from jax_tma.ops.dense.api import dense, gated_dense, gated_mlp, mlp
from jax_tma.ops.dense.config import DENSE_CONFIGS
from jax_tma.ops.fp8.api import fp8_dot_general, fp8_matmul
from jax_tma.ops.fp8.autotune import fp8_autotune
from jax_tma.ops.fp8.config import FP8_CONFIGS, FP8_FAST_CONFIGS, FP8_RAGGED_CONFIGS, Fp8Config
from jax_tma.ops.fp8.quantize import quantize_fp8
from jax_tma.ops.fp8.ragged import fp8_ragged_dot
from jax_tma.ops.gemm.api import dot_general, matmul
from jax_tma.ops.gemm.autotune import TuneResult, autotune
from jax_tma.ops.gemm.config import COMPILED_CONFIGS, GemmConfig, default_config
from jax_tma.ops.moe.api import MoeStats, moe_mlp
from jax_tma.ops.ragged.api import ragged_dot, ragged_dot_general
from jax_tma.ops.ragged.config import GATED_RAGGED_CONFIGS, RAGGED_CONFIGS
from jax_tma.ops.ragged.gated import gated_ragged_dot
from jax_tma.ops.ragged.gated_mlp import gated_ragged_mlp

__version__ = "0.1.0"

__all__ = [
    "COMPILED_CONFIGS",
    "DENSE_CONFIGS",
    "FP8_CONFIGS",
    "FP8_FAST_CONFIGS",
    "FP8_RAGGED_CONFIGS",
    "Fp8Config",
    "GemmConfig",
    "KernelStatus",
    "MoeStats",
    "TuneResult",
    "autotune",
    "default_config",
    "dense",
    "dot_general",
    "export_disabled_checks",
    "fp8_autotune",
    "fp8_dot_general",
    "fp8_matmul",
    "fp8_ragged_dot",
    "gated_dense",
    "gated_mlp",
    "gated_ragged_dot",
    "gated_ragged_mlp",
    "GATED_RAGGED_CONFIGS",
    "kernel_status",
    "matmul",
    "mlp",
    "moe_mlp",
    "quantize_fp8",
    "ragged_dot",
    "ragged_dot_general",
    "RAGGED_CONFIGS",
]


def __getattr__(name: str):
    # jax_tma.flax without a prior `import jax_tma.flax`: imported on first use, since flax is
    # an optional dependency the rest of the package does not need.
    if name == "flax":
        import importlib  # noqa: PLC0415

        return importlib.import_module("jax_tma.flax")
    raise AttributeError(f"module 'jax_tma' has no attribute {name!r}")
