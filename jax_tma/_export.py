"""``jax.export`` of functions that use jax_tma's kernels: the safety checks to disable.

jax.export serializes only the custom calls that jax guarantees stable; jax_tma's FFI targets
(named ``jax_tma_*``, fixed for a release) pass with the checks listed here. The lowerings
themselves need nothing else: an exported module holds each product (custom_partitioning, whose
callbacks cannot be serialized, is left out of it; see _core/primitive.define_primitive).
"""

from __future__ import annotations

import jax

from jax_tma.ops.dense import primitive as dense
from jax_tma.ops.fp8 import primitive as fp8
from jax_tma.ops.fp8 import quantize_primitive as fp8_quantize
from jax_tma.ops.fp8 import ragged_primitive as fp8_ragged
from jax_tma.ops.gemm import primitive as gemm
from jax_tma.ops.ragged import gated_grad_primitive as gated_ragged_grad
from jax_tma.ops.ragged import gated_primitive as gated_ragged
from jax_tma.ops.ragged import primitive as ragged

# Each op's target (registered by the extension _jax_tma) and its "_into" variant, which writes
# over a given buffer (tests; registered by the test extension _jax_tma_testing).
FFI_TARGETS: tuple[str, ...] = (
    *gemm.FFI_TARGETS,
    *(op.KERNEL_TARGET + suffix
      for op in (dense, fp8, fp8_ragged, fp8_quantize, ragged, gated_ragged, gated_ragged_grad)
      for suffix in ("", "_into")),
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
