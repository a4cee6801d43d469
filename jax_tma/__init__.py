"""jax_tma: Hopper (sm_90a) kernels built on the Tensor Memory Accelerator, for JAX.

Importing the package registers the kernels' XLA FFI targets for the CUDA platform.

Public API:
  matmul(a, b, *, out_dtype=None, config=None): ``jnp.matmul`` on the TMA/wgmma kernel.
  GemmConfig: a compiled tile configuration to pass as ``config=``.
  kernel_status(): whether the kernels run on the default backend, and why not.
"""

from jax_tma._ext import KernelStatus, kernel_status
from jax_tma.gemm import COMPILED_CONFIGS, GemmConfig, default_config, matmul

__version__ = "0.1.0"

__all__ = [
    "COMPILED_CONFIGS",
    "GemmConfig",
    "KernelStatus",
    "default_config",
    "kernel_status",
    "matmul",
]
