"""Tuned configurations of GEMM products: the autotuning cache's entries (jax_tma/_core/
tuning_cache.py) under the key of one product, checked against what the kernel compiles now.
``jax_tma.autotune`` (autotune.py) writes them; the lowering (primitive.py) reads them first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_tma._core.tuning_cache import entries
from jax_tma.ops.gemm.config import GemmConfig, scored_configs
from jax_tma.ops.gemm.plan import GemmPlan, out_strides


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


def valid_entry(plan: GemmPlan, in_dtype, out_dtype) -> tuple[GemmConfig, dict] | None:
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
    the cache; None without a valid entry (valid_entry)."""
    found = valid_entry(plan, in_dtype, out_dtype)
    return None if found is None else (found[0], entry_times(*found))


def lookup(plan: GemmPlan, in_dtype, out_dtype) -> GemmConfig | None:
    """The cached configuration of this product (valid_entry), or None."""
    found = cached(plan, in_dtype, out_dtype)
    return None if found is None else found[0]


def measured_against_xla(plan: GemmPlan, in_dtype, out_dtype) -> tuple[float, float] | None:
    """(the cached configuration's seconds, XLA's dot's seconds) per product as autotune
    measured them, or None without a valid entry that timed both."""
    found = cached(plan, in_dtype, out_dtype)
    return None if found is None else found[1]


def entry_times(cfg: GemmConfig, entry: dict) -> tuple[float, float] | None:
    """(`cfg`'s seconds, XLA's seconds) from a cache entry, or None where it lacks either."""
    kernel_s, xla_s = entry.get("seconds", {}).get(cfg.describe()), entry.get("xla_seconds")
    ok = all(isinstance(t, (int, float)) and 0 < t < float("inf") for t in (kernel_s, xla_s))
    return (float(kernel_s), float(xla_s)) if ok else None


def config_or_none(fields) -> GemmConfig | None:
    """A cache entry's configuration fields as a GemmConfig, or None (absent, or no longer a
    compiled configuration)."""
    try:
        return GemmConfig(**fields) if fields else None
    except (TypeError, ValueError):
        return None
