"""Tuned configurations of FP8 products: the autotuning cache's entries (jax_tma/_core/
tuning_cache.py) under the key of one product of the FP8 kernel, checked against what the kernel
compiles now. ``jax_tma.fp8_autotune`` (autotune.py) writes them; the kernel's lowering
(primitive.py) reads them before the heuristic.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax_tma._core.tuning_cache import entries
from jax_tma.ops.fp8.config import Fp8Config, ranked_configs


@dataclasses.dataclass(frozen=True)
class Product:
    """The FP8 kernel's product as its primitive is bound: a [M, K] and b [N, K] of one FP8
    type, the output type, promoted (every 128 K) or fast accumulation, block scales read."""
    m: int
    n: int
    k: int
    dtype: Any
    out_dtype: Any
    promote: bool
    block: bool

    @classmethod
    def of(cls, operands, params) -> "Product":
        """From the primitive's operands (anything with .shape and .dtype) and parameters."""
        a, b = operands[0], operands[1]
        return cls(a.shape[0], b.shape[0], a.shape[1], jnp.dtype(a.dtype),
                   jnp.dtype(params["out_dtype"]), bool(params["promote"]),
                   bool(params["has_sa"] or params["has_sb"]))

    def key(self, device_kind: str | None = None) -> str:
        """The cache's key: device kind, FP8 and output types, accumulation, scales, shape."""
        if device_kind is None:
            device_kind = jax.devices()[0].device_kind
        return "|".join([device_kind, "fp8", self.dtype.name, self.out_dtype.name,
                         "promoted" if self.promote else "fast",
                         "block" if self.block else "tensor", f"m{self.m}n{self.n}k{self.k}"])

    def candidates(self) -> list[Fp8Config]:
        """The configurations autotune times: the heuristic's ranking, best first, then the
        compiled tiles it has no rate for and stream-K where it applies."""
        return ranked_configs(self.m, self.n, self.k, fast=not self.promote,
                              measured_only=False)


def config_or_none(fields) -> Fp8Config | None:
    """A cache entry's configuration fields as an Fp8Config, or None (absent, not every field,
    or no longer a compiled configuration). An entry written before `stream_k` existed runs
    without it."""
    names = {f.name for f in dataclasses.fields(Fp8Config)}
    if not isinstance(fields, dict) or not names - {"stream_k"} <= set(fields) <= names:
        return None
    try:
        return Fp8Config(**fields)
    except (TypeError, ValueError):
        return None


def lookup(product: Product) -> Fp8Config | None:
    """The cached configuration of `product`, if any and still one autotune would time for it
    (an entry naming a tile no longer compiled, or one that cannot compute it, is ignored)."""
    entry = entries().get(product.key())
    cfg = config_or_none(entry.get("config")) if isinstance(entry, dict) else None
    return cfg if cfg is not None and cfg in product.candidates() else None


def config_for(product: Product) -> Fp8Config:
    """The configuration the kernel runs `product` with when no config= is given: the cached
    one, else the heuristic's (the first candidate)."""
    cached = lookup(product)
    if cached is not None:
        return cached
    return ranked_configs(product.m, product.n, product.k, fast=not product.promote)[0]
