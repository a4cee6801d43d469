"""Autotuning of the dense GEMM's configuration, with a persistent cache.

``default_config``'s cost model was fitted to a suite of shapes; on others its pick can be a
few percent to 20% slower than the best compiled configuration, and the rule that leaves a
product to XLA's dot (gemm.why_xla) can be wrong either way. ``autotune(lhs, rhs, ...)`` times
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

The cache is ``$JAX_TMA_AUTOTUNE_CACHE`` or ``<cache dir>/jax_tma/autotune.json`` (``<cache dir>``:
``$XDG_CACHE_HOME`` or ``~/.cache``). Writers take an exclusive lock on a sibling ``.lock``
file, merge their entries into what is on disk and replace the file atomically, so concurrent
processes lose no entry and readers never see a partial file. Results do not depend on the
configuration beyond floating-point summation order (split-K sums partial products).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import tempfile
from typing import Any

import jax
import jax.numpy as jnp

from jax_tma import _ext, _timing
from jax_tma.gemm_config import GemmConfig, scored_configs
from jax_tma.gemm_plan import GemmPlan, out_strides

CACHE_VERSION = 1
_ENV = "JAX_TMA_AUTOTUNE"
_CACHE_ENV = "JAX_TMA_AUTOTUNE_CACHE"


def enabled() -> bool:
    """Whether ``JAX_TMA_AUTOTUNE`` asks for tuning at trace time (_ext.env_flag; unset: no)."""
    return _ext.env_flag(_ENV, default=False, on="to tune products when traced",
                         off="to read the cache only")


def cache_path() -> pathlib.Path:
    """Where the cache lives (see the module's docstring)."""
    explicit = os.environ.get(_CACHE_ENV, "").strip()
    if explicit:
        return pathlib.Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join("~", ".cache")
    return pathlib.Path(base).expanduser() / "jax_tma" / "autotune.json"


def cache_key(plan: GemmPlan, in_dtype, out_dtype, device_kind: str | None = None) -> str:
    """The cache's key of one product: device kind, input and output dtypes, layout (which
    operands are transposed, which rows are misaligned, the output's strides) and shape."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    return "|".join([
        device_kind, jnp.dtype(in_dtype).name, jnp.dtype(out_dtype).name, plan.layout,
        f"misaligned={plan.misaligned_rows or '-'}",
        f"d_strides={plan.d_m_stride},{plan.d_batch_stride}",
        f"b{plan.batch}m{plan.m}n{plan.n}k{plan.k}",
    ])


# ---------------------------------------------------------------------------------------
# The cache file.

_memory: dict[str, tuple[float, dict[str, Any]]] = {}  # path -> (mtime, entries)


def _read(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise RuntimeError(f"jax_tma: the autotuning cache {path} cannot be read ({err}); "
                           f"delete it or point {_CACHE_ENV} elsewhere") from err
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}  # another version's cache: ignored, rewritten on the next store
    entries = data.get("entries", {})
    return entries if isinstance(entries, dict) else {}


def entries() -> dict[str, Any]:
    """Every cached entry (re-read when the file changed)."""
    path = cache_path()
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        return {}
    cached = _memory.get(str(path))
    if cached is None or cached[0] != mtime:
        cached = (mtime, _read(path))
        _memory[str(path)] = cached
    return cached[1]


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def store(key: str, entry: dict[str, Any]) -> None:
    """Adds one entry: under the lock, merged into the file's current entries, written to a
    temporary file and renamed over the cache."""
    path = cache_path()
    with _locked(path):
        merged = dict(_read(path))
        merged[key] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": CACHE_VERSION, "entries": merged}, f, indent=1,
                          sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    _memory.pop(str(path), None)


def _valid_entry(plan: GemmPlan, in_dtype, out_dtype) -> tuple[GemmConfig, dict] | None:
    """The cached configuration of this product and its entry, if any and if the configuration
    is still one autotune would time for it (an entry naming a tile no longer compiled, or one
    that cannot compute the product, is ignored)."""
    entry = entries().get(cache_key(plan, in_dtype, out_dtype))
    if entry is None:
        return None
    try:
        cfg = GemmConfig(**entry["config"])
    except (KeyError, TypeError, ValueError):
        return None
    legal = scored_configs(plan.m, plan.n, plan.k, jnp.dtype(out_dtype), out_strides(plan),
                           batch=plan.batch)
    return (cfg, entry) if cfg in legal else None


def cached(plan: GemmPlan, in_dtype, out_dtype
           ) -> tuple[GemmConfig, tuple[float, float] | None] | None:
    """(the cached configuration of this product, (its seconds, XLA's dot's seconds) per
    product as autotune measured them or None where the entry lacks either), from one read of
    the cache; None without a valid entry (_valid_entry)."""
    found = _valid_entry(plan, in_dtype, out_dtype)
    return None if found is None else (found[0], _entry_times(*found))


def lookup(plan: GemmPlan, in_dtype, out_dtype) -> GemmConfig | None:
    """The cached configuration of this product (_valid_entry), or None."""
    found = cached(plan, in_dtype, out_dtype)
    return None if found is None else found[0]


def measured_against_xla(plan: GemmPlan, in_dtype, out_dtype) -> tuple[float, float] | None:
    """(the cached configuration's seconds, XLA's dot's seconds) per product as autotune
    measured them, or None without a valid entry that timed both."""
    found = cached(plan, in_dtype, out_dtype)
    return None if found is None else found[1]


def _entry_times(cfg: GemmConfig, entry: dict) -> tuple[float, float] | None:
    """(`cfg`'s seconds, XLA's seconds) from a cache entry, or None where it lacks either."""
    kernel_s, xla_s = entry.get("seconds", {}).get(cfg.describe()), entry.get("xla_seconds")
    ok = all(isinstance(t, (int, float)) and 0 < t < float("inf") for t in (kernel_s, xla_s))
    return (float(kernel_s), float(xla_s)) if ok else None


# ---------------------------------------------------------------------------------------
# Tuning.


def candidates(plan: GemmPlan, out_dtype, limit: int | None = None) -> list[GemmConfig]:
    """The configurations worth timing: those default_config scores, best first by its cost
    model on this device (gemm.ranked_for), the first `limit` of them (None: all)."""
    from jax_tma import gemm  # noqa: PLC0415 (gemm imports this module)

    return gemm.ranked_for(plan, out_dtype)[:limit]


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
    if max_candidates is not None and (isinstance(max_candidates, bool)
                                       or not isinstance(max_candidates, int)
                                       or max_candidates < 1):
        raise ValueError(f"jax_tma.autotune: max_candidates must be a positive int or None, got "
                         f"{max_candidates!r}")
    from jax_tma import gemm  # noqa: PLC0415 (gemm imports this module)

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
    dims = gemm._normalize(dimension_numbers, len(lhs.shape), len(rhs.shape))
    route = gemm.kernel_route(lhs_s, rhs_s, dims, out.dtype,
                              gemm.canonicalize_precision(precision))
    if route is None:
        raise ValueError(f"jax_tma.autotune: the kernel does not compute {lhs.shape} "
                         f"{jnp.dtype(lhs.dtype).name} x {rhs.shape} {jnp.dtype(rhs.dtype).name} "
                         f"with {dimension_numbers} (it runs on XLA)")
    plan = route.plan
    key = cache_key(plan, lhs.dtype, out.dtype)
    found = None if force else _valid_entry(plan, lhs.dtype, out.dtype)
    if found is not None:
        cached, entry = found
        measured = _entry_times(cached, entry)
        return TuneResult(key, cached, _config_or_none(entry.get("default")),
                          dict(entry.get("seconds", {})), measured and measured[1])
    configs = candidates(plan, out.dtype, max_candidates)
    if not configs:
        raise ValueError(f"jax_tma.autotune: no compiled configuration computes {key}")
    default = gemm.config_for(plan, out.dtype, None, use_cache=False)
    seconds, xla_s = _time(configs, lhs_s, rhs_s, dimension_numbers, preferred_element_type,
                           precision, rounds, sets)
    best = min(configs, key=lambda c: seconds[c.describe()])
    store(key, {"config": dataclasses.asdict(best),
                "default": dataclasses.asdict(default) if default is not None else None,
                "seconds": seconds, "xla_seconds": xla_s, "method": _timing.timing_method()})
    return TuneResult(key, best, default, seconds, xla_s)


def _config_or_none(fields) -> GemmConfig | None:
    try:
        return GemmConfig(**fields) if fields else None
    except (TypeError, ValueError):
        return None


_XLA = "xla"  # XLA's dot among the contenders (no GemmConfig.describe() reads so)


def _time(configs, lhs, rhs, dimension_numbers, preferred_element_type, precision, rounds,
          sets) -> tuple[dict[str, float], float]:
    """Median seconds per product of each configuration (by GemmConfig.describe()) and of XLA's
    dot, all timed in one harness run."""
    from jax_tma import gemm  # noqa: PLC0415

    # Executed now even when called while a jit is being traced (JAX_TMA_AUTOTUNE=1).
    with jax.ensure_compile_time_eval():
        operand_sets = _timing.random_operands(jax.random.key(0), [lhs.shape, rhs.shape],
                                               lhs.dtype, sets)
        operand_sets = [(a, b.astype(rhs.dtype)) for a, b in operand_sets]
        contenders = {
            cfg.describe(): (lambda a, b, cfg=cfg: gemm.dot_general(
                a, b, dimension_numbers, precision=precision,
                preferred_element_type=preferred_element_type, config=cfg))
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
    if lookup(plan, lhs.dtype, out_dtype) is not None:
        return
    autotune(jax.ShapeDtypeStruct(lhs.shape, lhs.dtype), jax.ShapeDtypeStruct(rhs.shape, rhs.dtype),
             dimension_numbers, preferred_element_type=preferred_element_type,
             precision=precision)
