"""``jax.export`` of functions that use jax_tma's kernels: the safety checks to disable.

jax.export serializes only the custom calls that jax guarantees stable; jax_tma's FFI targets
(named ``jax_tma_*``, fixed for a release) pass with the checks listed here. The lowerings
themselves need nothing else: an exported module holds each product (custom_partitioning, whose
callbacks cannot be serialized, is left out of it; see gemm._lowering).
"""

from __future__ import annotations

import jax

from jax_tma import epilogues, fp8, gemm, ragged

# Each op's target and its "_into" variant (which writes over a given buffer: tests).
FFI_TARGETS: tuple[str, ...] = (
    *gemm.FFI_TARGETS,
    *(op.KERNEL_TARGET + suffix for op in (epilogues, fp8, ragged) for suffix in ("", "_into")),
)


def export_disabled_checks() -> list:
    """The ``jax.export.DisabledSafetyCheck`` entries that let ``jax.export`` serialize a
    function using jax_tma's kernels for CUDA::

        exported = jax.export.export(jax.jit(f), platforms=("cuda",),
                                     disabled_checks=jax_tma.export_disabled_checks())(*specs)

    One entry per FFI target (``FFI_TARGETS``), whose names and attributes stay fixed for a
    release of jax_tma. The module calls them by name: the process that deserializes and runs
    it must import the same jax_tma release (which registers them) and run on a Hopper GPU.
    Modules exported for other platforms contain no jax_tma call and need none of these.
    Sharded ``dot_general`` products export too, but without jax_tma's sharding rules
    (custom_partitioning callbacks cannot be serialized): XLA's partitioner gives each device
    whole operands of every kernel call.
    """
    return [jax.export.DisabledSafetyCheck.custom_call(target) for target in FFI_TARGETS]
