"""One way to define a jax_tma primitive, and the pieces of its kernel calls every op shares.

``define_primitive`` gives an op's primitive, from its abstract evaluation, its lax reference
and two op-specific decisions, everything else every op needs, alike:

- the eager implementation: the primitive bound inside ``jax.jit`` (one compiled function per
  set of parameters);
- a lowering for every platform: XLA's form of the reference (``mlir.lower_fun``), and on CUDA
  the kernel call that ``kernel_fn`` returns where the kernel applies and the process may emit
  jax_tma custom calls (``_ext.cuda_lowering_blocker``), the reference elsewhere;
- around that local lowering, the ``custom_partitioning`` call that ``partitioned`` builds, whose
  per-device body binds the primitive again with ``local=True``. ``jax.export`` cannot serialise
  custom_partitioning (its callback lives in this process), so an exported module holds the
  local lowering, which XLA's partitioner treats as any custom call;
- the registration jit needs to hand custom_partitioning the device assignment while lowering.

An op keeps its own rules (batching, JVP, transpose): they differ by what the op computes.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.interpreters import mlir

from jax_tma import _ext
from jax_tma._core.aval import Primitive

# fn(avals_in, params) -> the kernel's lowering function of the operands, or None for XLA's.
KernelFn = Callable[..., Callable | None]


def for_export(ctx) -> bool:
    """Whether this lowering is for ``jax.export`` (no custom_partitioning then)."""
    params = getattr(ctx.module_context, "lowering_parameters", None)
    return bool(getattr(params, "for_export", False))


def define_primitive(name: str, *, abstract_eval: Callable, reference: Callable,
                     kernel_fn: KernelFn, partitioned: Callable,
                     multiple_results: bool = False) -> Primitive:
    """The primitive `name` with its implementation, lowerings and registration.

    Args:
      abstract_eval: ``abstract_eval(*avals, **params)``.
      reference: ``reference(*operands, **params)`` in lax: the XLA form.
      kernel_fn: ``kernel_fn(avals_in, params)``: on CUDA, the function of the operands that
        calls the kernel, or None where the kernel does not apply (then the reference runs).
      partitioned: ``partitioned(params)``: the function of the operands that wraps the local
        product in custom_partitioning (binding the primitive with ``local=True``).
      multiple_results: whether the primitive returns a list.
    Every op's parameters include ``local``: True inside the partitioned body.
    """
    prim = Primitive(name)
    prim.multiple_results = multiple_results

    @functools.cache
    def jitted(**params):
        return jax.jit(functools.partial(prim.bind, **params))

    def local_lowering(ctx, *args, platform: str, **params):
        fn = None
        if platform == "cuda" and _ext.cuda_lowering_blocker() is None:
            fn = kernel_fn(ctx.avals_in, params)
        if fn is None:
            fn = functools.partial(reference, **params)
        return mlir.lower_fun(fn, multiple_results=multiple_results)(ctx, *args)

    def lowering(ctx, *args, platform: str, **params):
        if params["local"] or for_export(ctx):
            return local_lowering(ctx, *args, platform=platform, **params)
        return mlir.lower_fun(partitioned(params), multiple_results=multiple_results)(ctx, *args)

    prim.def_impl(lambda *args, **params: jitted(**params)(*args))
    prim.def_abstract_eval(abstract_eval)
    # NOTE: the lowering emits custom_partitioning, which needs the device assignment while
    # lowering; jit provides it only for primitives in this set (jax has no public hook for it).
    dispatch.prim_requires_devices_during_lowering.add(prim)
    mlir.register_lowering(prim, functools.partial(lowering, platform="default"))
    mlir.register_lowering(prim, functools.partial(lowering, platform="cuda"), platform="cuda")
    return prim


def planned_call(call: Callable, plan, params: dict) -> Callable | None:
    """``call`` with the kernel's plan and the primitive's parameters but ``local`` bound: a
    ``kernel_fn``'s result; None (XLA's reference runs) without a plan."""
    if plan is None:
        return None
    return functools.partial(call, plan=plan, **{k: v for k, v in params.items() if k != "local"})


def bind_local(prim: Primitive) -> Callable:
    """``bind(*operands, **params)`` of one device's share (``local=True``): what the
    partitioned body calls."""
    return lambda *args, **params: prim.bind(*args, **{**params, "local": True})


def kernel_ffi_call(target: str, result_types, operands, attrs: dict, *, poison: bool = False,
                    poisoned: tuple[int, ...] = (0,)):
    """``jax.ffi.ffi_call(target)`` of the operands with these attributes. With `poison` (the
    tests' check that a kernel writes every output element) the call goes to ``target +
    "_into"`` (registered by the testing extension, jax_tma._testing) with the results numbered
    in `poisoned` passed in NaN-filled and aliased to the outputs."""
    if not poison:
        return jax.ffi.ffi_call(target, result_types)(*operands, **attrs)
    nans = [jnp.full(result_types[i].shape, jnp.nan, result_types[i].dtype) for i in poisoned]
    aliases = {len(operands) + j: i for j, i in enumerate(poisoned)}
    return jax.ffi.ffi_call(target + "_into", result_types, input_output_aliases=aliases)(
        *operands, *nans, **attrs)


def sum_split_partials(d: jax.Array) -> jax.Array:
    """Sum over the leading axis of split-K partial products, in a fixed order:
    ((d[0] + d[1]) + d[2]) + ... as one elementwise fusion. A reduce leaves the order to the
    emitter XLA picks when it compiles, and on an H100 two processes compiling the same
    reduce-then-convert got outputs that differ in the last bf16 bit."""
    total = d[0]
    for i in range(1, d.shape[0]):
        total = total + d[i]
    return total
