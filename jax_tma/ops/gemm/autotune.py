"""Autotuning of the dense GEMM's configuration, with a persistent cache.

``default_config``'s cost model was fitted to a suite of shapes; on others its pick can be a
few percent to 20% slower than the best compiled configuration, and the rule that leaves a
product to XLA's dot (primitive.why_xla) can be wrong either way. ``autotune(lhs, rhs, ...)`` times
every legal configuration of one product on the device (the heuristic's pick among them) and
XLA's dot of the same product, each over distinct random operands of the given shapes and
dtypes in one harness run (the benchmarks': CUPTI kernel time), and stores the fastest
configuration and XLA's time in a JSON cache keyed by device kind, dtypes, layout and shape.
Whenever a product is lowered without an explicit ``config=``, that cache comes first: the
kernel with the tuned configuration, or XLA's dot where it measured faster than the kernel's
best; the heuristic and the rule stay the fallback for products not in the cache.

Tuning happens where it is asked for:
  * ``jax_tma.autotune(lhs, rhs, dimension_numbers)`` (arrays or ``jax.ShapeDtypeStruct``s),
    ahead of the jitted code, for products one knows;
  * ``JAX_TMA_AUTOTUNE=1``: ``jax_tma.dot_general`` / ``matmul`` tune a product whose key is not
    in the cache when they are traced (once per key and cache; the first trace takes the tuning
    time, about 10 ms of kernel time per candidate plus each candidate's compilation).
Sharded and vmapped calls are tuned for the product they are called with; the local products
of a sharded call read the cache under their own (local) shapes.

The cache itself: jax_tma/_core/tuning_cache.py; its GEMM entries: tuned.py. Results do not
depend on the configuration beyond floating-point summation order (split-K sums partial
products).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.lax.lax import canonicalize_precision

from jax_tma import _ext, _timing
from jax_tma._core.tuning_cache import store
from jax_tma.ops.gemm import tuned
from jax_tma.ops.gemm.config import GemmConfig
from jax_tma.ops.gemm.plan import GemmPlan, normalize
from jax_tma.ops.gemm.primitive import config_for, dot_general_p, kernel_route, ranked_for

_ENV = "JAX_TMA_AUTOTUNE"


def enabled() -> bool:
    """Whether ``JAX_TMA_AUTOTUNE`` asks for tuning at trace time (_ext.env_flag; unset: no)."""
    return _ext.env_flag(_ENV, default=False, on="to tune products when traced",
                         off="to read the cache only")


def candidates(plan: GemmPlan, out_dtype, limit: int | None = None) -> list[GemmConfig]:
    """The configurations worth timing: those default_config scores, best first by its cost
    model on this device (primitive.ranked_for), the first `limit` of them (None: all)."""
    return ranked_for(plan, out_dtype)[:limit]


def check_max_candidates(value, op: str) -> None:
    """A tuner's max_candidates: a positive int or None, else a ValueError naming `op`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"{op}: max_candidates must be a positive int or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TuneResult:
    key: str
    best: GemmConfig
    default: GemmConfig | None
    seconds: dict[str, float]  # GemmConfig.describe() -> median seconds per product
    xla_seconds: float | None = None  # XLA's dot, same harness (None: an entry without it)

    @property
    def speedup(self) -> float:
        """The heuristic's time / the best's (1.0 where the heuristic's pick was not timed)."""
        if self.default is None or self.default.describe() not in self.seconds:
            return 1.0
        return self.seconds[self.default.describe()] / self.seconds[self.best.describe()]

    @property
    def xla_faster(self) -> bool:
        """Whether XLA's dot beat the best configuration (the lowering then runs XLA's)."""
        return self.xla_seconds is not None and self.xla_seconds < self.seconds[
            self.best.describe()]


def autotune(lhs: Any, rhs: Any, dimension_numbers=None, *, preferred_element_type=None,
             precision=None, rounds: int = 3, sets: int = 2, force: bool = False,
             max_candidates: int | None = None) -> TuneResult:
    """Times every legal configuration of ``jax_tma.dot_general(lhs, rhs, dimension_numbers)``
    (``dimension_numbers=None``: ``matmul`` of 2-D operands) and ``lax.dot_general`` of the same
    product on the device, and caches the fastest configuration with XLA's time: the lowering
    then runs the kernel with it, or XLA's dot where that was faster. ``lhs`` and ``rhs`` may be
    arrays or ``jax.ShapeDtypeStruct``s: only their shapes and dtypes are used (the timing runs
    on random operands). ``max_candidates`` times only the configurations the cost model ranks
    first (None: all; each costs a compilation and ``rounds`` x ``sets`` x 2 products). A key
    already cached is returned without timing unless ``force``. Raises RuntimeError where the
    kernels cannot run here and ValueError for a product the kernel does not compute (it runs on
    XLA: nothing to tune)."""
    check_max_candidates(max_candidates, "jax_tma.autotune")
    if dimension_numbers is None:
        if len(lhs.shape) != 2 or len(rhs.shape) != 2:
            raise ValueError(f"jax_tma.autotune: without dimension_numbers lhs and rhs must be "
                             f"2-D (a matmul), got {lhs.shape} and {rhs.shape}")
        dimension_numbers = (((1,), (0,)), ((), ()))
    status = _ext.kernel_status()
    if not status.available:
        raise RuntimeError(f"jax_tma.autotune: the kernels cannot run here ({status.reason})")
    lhs_s = jax.ShapeDtypeStruct(lhs.shape, lhs.dtype)
    rhs_s = jax.ShapeDtypeStruct(rhs.shape, rhs.dtype)
    out = jax.eval_shape(lambda a, b: jax.lax.dot_general(
        a, b, dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type), lhs_s, rhs_s)
    dims = normalize(dimension_numbers, len(lhs.shape), len(rhs.shape))
    canonical = canonicalize_precision(precision)
    route = kernel_route(lhs_s, rhs_s, dims, out.dtype, canonical)
    if route is None:
        raise ValueError(f"jax_tma.autotune: the kernel does not compute {lhs.shape} "
                         f"{jnp.dtype(lhs.dtype).name} x {rhs.shape} {jnp.dtype(rhs.dtype).name} "
                         f"with {dimension_numbers} (it runs on XLA)")
    plan = route.plan
    key = tuned.cache_key(plan, lhs.dtype, out.dtype)
    found = None if force else tuned.valid_entry(plan, lhs.dtype, out.dtype)
    if found is not None:
        cached, entry = found
        measured = tuned.entry_times(cached, entry)
        return TuneResult(key, cached, tuned.config_or_none(entry.get("default")),
                          dict(entry.get("seconds", {})), measured and measured[1])
    configs = candidates(plan, out.dtype, max_candidates)
    if not configs:
        raise ValueError(f"jax_tma.autotune: no compiled configuration computes {key}")
    default = config_for(plan, out.dtype, None, use_cache=False)
    seconds, xla_s = _time(configs, lhs_s, rhs_s, dimension_numbers, dims, out.dtype,
                           preferred_element_type, precision, rounds, sets)
    best = min(configs, key=lambda c: seconds[c.describe()])
    store(key, {"config": dataclasses.asdict(best),
                "default": dataclasses.asdict(default) if default is not None else None,
                "seconds": seconds, "xla_seconds": xla_s, "method": _timing.timing_method()})
    return TuneResult(key, best, default, seconds, xla_s)


_XLA = "xla"  # XLA's dot among the contenders (no GemmConfig.describe() reads so)


def _time(configs, lhs, rhs, dimension_numbers, dims, out_dtype, preferred_element_type,
          precision, rounds, sets) -> tuple[dict[str, float], float]:
    """Median seconds per product of each configuration (by GemmConfig.describe()) and of XLA's
    dot, all timed in one harness run. The kernel's contenders bind the primitive as
    ``jax_tma.dot_general(..., config=cfg)`` does for these operands (one dtype, which the
    kernel reads as it is: kernel_route found a route), `dims` the normalized
    `dimension_numbers`."""
    canonical = canonicalize_precision(precision)
    # Executed now even when called while a jit is being traced (JAX_TMA_AUTOTUNE=1).
    with jax.ensure_compile_time_eval():
        operand_sets = _timing.random_operands(jax.random.key(0), [lhs.shape, rhs.shape],
                                               lhs.dtype, sets)
        operand_sets = [(a, b.astype(rhs.dtype)) for a, b in operand_sets]
        contenders = {
            cfg.describe(): (lambda a, b, cfg=cfg: dot_general_p.bind(
                a, b, dimension_numbers=dims, out_dtype=jnp.dtype(out_dtype),
                precision=canonical, config=cfg, local=False))
            for cfg in configs}
        contenders[_XLA] = lambda a, b: jax.lax.dot_general(
            a, b, dimension_numbers, precision=precision,
            preferred_element_type=preferred_element_type)
        timings = _timing.compare(contenders, operand_sets, rounds=rounds, iterations=2)
    seconds = {name: t.median_s for name, t in timings.items()}
    return seconds, seconds.pop(_XLA)


def tune_missing(lhs, rhs, dimension_numbers, plan: GemmPlan, out_dtype, precision,
                 preferred_element_type) -> None:
    """Tunes a product being traced (JAX_TMA_AUTOTUNE=1) unless its key is cached."""
    if tuned.lookup(plan, lhs.dtype, out_dtype) is not None:
        return
    autotune(jax.ShapeDtypeStruct(lhs.shape, lhs.dtype), jax.ShapeDtypeStruct(rhs.shape, rhs.dtype),
             dimension_numbers, preferred_element_type=preferred_element_type,
             precision=precision)
