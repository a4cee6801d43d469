"""Autotuning of the FP8 kernel's configuration: ``jax_tma.fp8_autotune``, in the GEMM's cache.

As ``jax_tma.autotune`` does for the 16-bit product (jax_tma/ops/gemm/autotune.py):
``fp8_autotune(lhs, rhs, lhs_scale, rhs_scale, dimension_numbers)`` finds the product the FP8
kernel computes for that call (its operands as the kernel reads them, the scale forms, promoted
or fast accumulation), times every compiled configuration for it (config.ranked_configs: the
heuristic's ranking, then the tiles it has no rate for and stream-K; split-K where the tiles
fill less than one wave) over random operands of those shapes in one harness run (CUPTI kernel
time), and stores the fastest in the autotuning cache (jax_tma/_core/tuning_cache.py), keyed by
device kind, FP8 type, output type, accumulation, whether block scales are read, and M, N, K. The
kernel's lowering reads the cache before the heuristic. With ``JAX_TMA_AUTOTUNE=1``
fp8_dot_general and fp8_matmul tune a product whose key is missing when they are traced (as
dot_general does).

The key is the product each device's kernel runs: a vmapped call runs its batch folded into M,
a sharded one its local blocks; tune those shapes with fp8_autotune (trace-time tuning tunes
the call's own product, and skips vmapped calls). The epilogue's operands (row or column
scales, bias) are not in the key.

XLA's FP8 dot is not a contender: it takes per-tensor scales only, and where the kernel runs
it computes the op's own definition. Results do not depend on the configuration beyond
floating-point summation order (split-K sums fp32 partial products).
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
from jax._src.interpreters.batching import BatchTracer  # (not public in jax 0.10)

from jax_tma import _ext, _timing
from jax_tma._core.tuning_cache import entries, store
from jax_tma.ops.fp8 import primitive as fp8
from jax_tma.ops.fp8.primitive import fp8_dot_p
from jax_tma.ops.fp8.tuned import Product, config_or_none, lookup
from jax_tma.ops.gemm.autotune import TuneResult, check_max_candidates, enabled


# Set while fp8_autotune traces the user's call to find the kernel's product: its own settings
# (rounds, candidates, force) decide, not trace-time tuning (JAX_TMA_AUTOTUNE=1).
_FINDING_PRODUCT = contextvars.ContextVar("jax_tma_fp8_finding_product", default=False)


def _kernel_equation(jaxpr):
    """The FP8 kernel's equation in a traced call (searching the sub-computations, such as the
    custom VJP's), or None where the call runs on XLA."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is fp8_dot_p:
            return eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if isinstance(inner, jax.extend.core.Jaxpr):
                found = _kernel_equation(inner)
                if found is not None:
                    return found
    return None


def fp8_autotune(lhs: Any, rhs: Any, lhs_scale: Any, rhs_scale: Any, dimension_numbers=None, *,
                 preferred_element_type: Any = None, precision: Any = None, rounds: int = 3,
                 sets: int = 2, force: bool = False,
                 max_candidates: int | None = None) -> TuneResult:
    """Times every configuration of the FP8 kernel's product for
    ``jax_tma.fp8_dot_general(lhs, rhs, lhs_scale, rhs_scale, dimension_numbers, ...)``
    (``dimension_numbers=None``: its default, rhs [N, K]) and caches the fastest; the
    lowering then runs the kernel with it. Operands and scales may be arrays or
    ``jax.ShapeDtypeStruct``s: only their shapes and dtypes are used (the timing runs on random
    values). ``max_candidates`` times only the heuristic's first ones (None: all). A key already
    cached is returned without timing unless ``force``. Raises RuntimeError where the kernels
    cannot run here and ValueError for a call the kernel does not compute (it runs on XLA)."""
    check_max_candidates(max_candidates, "jax_tma.fp8_autotune")
    status = _ext.kernel_status()
    if not status.available:
        raise RuntimeError(f"jax_tma.fp8_autotune: the kernels cannot run here ({status.reason})")
    from jax_tma.ops.fp8.api import fp8_dot_general  # (the op module imports this one)

    dims = (((1,), (1,)), ((), ())) if dimension_numbers is None else dimension_numbers
    specs = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
             for x in (lhs, rhs, lhs_scale, rhs_scale)]
    token = _FINDING_PRODUCT.set(True)
    try:
        closed = jax.make_jaxpr(lambda a, b, sa, sb: fp8_dot_general(
            a, b, sa, sb, dims, precision=precision,
            preferred_element_type=preferred_element_type))(*specs)
    finally:
        _FINDING_PRODUCT.reset(token)
    eqn = _kernel_equation(closed.jaxpr)
    avals = None if eqn is None else [v.aval for v in eqn.invars]
    if eqn is None or not (fp8.kernel_enabled() and fp8.kernel_applies(
            avals[0], avals[1], eqn.params["out_dtype"])):
        raise ValueError(
            f"jax_tma.fp8_autotune: the FP8 kernel does not compute {tuple(specs[0].shape)} "
            f"{jnp.dtype(specs[0].dtype).name} x {tuple(specs[1].shape)} "
            f"{jnp.dtype(specs[1].dtype).name} with scales {tuple(specs[2].shape)} and "
            f"{tuple(specs[3].shape)} (it runs on XLA)")
    return tune_product(avals, eqn.params, rounds=rounds, sets=sets, force=force,
                        max_candidates=max_candidates)


def tune_product(avals, params, *, rounds: int = 3, sets: int = 2, force: bool = False,
                 max_candidates: int | None = None) -> TuneResult:
    """fp8_autotune for the primitive's operands (`avals`) and parameters as bound."""
    product = Product.of(avals, params)
    key = product.key()
    cached = None if force else lookup(product)
    if cached is not None:
        entry = entries()[key]
        return TuneResult(key, cached, config_or_none(entry.get("default")),
                          dict(entry.get("seconds", {})))
    configs = product.candidates()[:max_candidates]
    default = configs[0] if configs else None
    seconds = _time(configs, avals, params, rounds, sets)
    best = min(configs, key=lambda c: seconds[c.describe()])
    store(key, {"config": dataclasses.asdict(best), "default": dataclasses.asdict(default),
                "seconds": seconds, "method": _timing.timing_method()})
    return TuneResult(key, best, default, seconds)


def _time(configs, avals, params, rounds, sets) -> dict[str, float]:
    """Median seconds per product of each configuration (by Fp8Config.describe()), in one
    harness run: the primitive bound as the traced call binds it, with config= each one, on
    random FP8 operands and scales of one (the timing does not depend on their values)."""
    # Executed now even when called while a jit is being traced (JAX_TMA_AUTOTUNE=1).
    with jax.ensure_compile_time_eval():
        a, b = avals[0], avals[1]
        pairs = _timing.random_operands(jax.random.key(0), [a.shape, b.shape], a.dtype, sets)
        rest = tuple(jnp.ones(x.shape, x.dtype) for x in avals[2:])
        operand_sets = [(x, y.astype(b.dtype), *rest) for x, y in pairs]
        contenders = {
            cfg.describe(): (lambda *ops, cfg=cfg: fp8_dot_p.bind(*ops, **{**params,
                                                                        "config": cfg}))
            for cfg in configs}
        timings = _timing.compare(contenders, operand_sets, rounds=rounds, iterations=2)
    return {name: t.median_s for name, t in timings.items()}


def tune_missing(operands, params) -> None:
    """Tunes a product being traced (JAX_TMA_AUTOTUNE=1) unless its key is cached, a config= is
    given, the kernel would not run it, or the call is vmapped (the batch folds into M: the
    kernel runs another product; tune that one with fp8_autotune)."""
    if not enabled() or params.get("config") is not None or _FINDING_PRODUCT.get():
        return
    if any(isinstance(x, BatchTracer) for x in operands):
        return
    avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in operands]
    if not (_ext.kernel_status().available and fp8.kernel_enabled()
            and fp8.kernel_applies(avals[0], avals[1], params["out_dtype"])):
        return
    if lookup(Product.of(avals, params)) is None:
        tune_product(avals, params)
