"""Internal entry points for tests; not part of the public API.

``gemm_into`` runs the GEMM kernel writing into a caller-provided buffer (aliased to the
output), so tests can poison the output first and prove that every element was written.
"""

from __future__ import annotations

import functools

import jax

from jax_tma import gemm


@functools.partial(jax.jit, static_argnames=("config",))
def gemm_into(a: jax.Array, b: jax.Array, d_init: jax.Array, config: gemm.GemmConfig | None = None):
    """Kernel result of ``a @ b`` written over ``d_init`` (shape [M, N], the output dtype)."""
    return gemm._kernel_call(
        a, b, out_dtype=d_init.dtype, config=config, target=gemm.KERNEL_TARGET + "_into", into=d_init
    )
