"""Configurations of the sm90 GEMM kernel with fused epilogues (csrc/contract/sm90_dense.h): the
tiles compiled per fusion kind and activation (jax_tma/_core/tiles.py), the check of a caller's
choice, and the heuristic that picks one (the dense GEMM's cost model).
"""

from __future__ import annotations

import dataclasses

from jax_tma._core import device, tiles
from jax_tma._core.config import fastest, require_among
from jax_tma.ops.gemm.config import GemmConfig, estimate_seconds

# Fusion kinds and activations of csrc/epilogue/fusion.h.
FORWARD, GRADIENT, GATED = "forward", "gradient", "gated"
GATED_GRADIENT = "gated_gradient"
_KIND = {FORWARD: 1, GRADIENT: 2, GATED: 3, GATED_GRADIENT: 5}
# (block_m, block_n, stages, cluster_m) of the tiles compiled with fused epilogues (the tile
# registry, jax_tma/_core/tiles.py); the forward gelu with erf is compiled on the narrow tiles
# only, the gated gradient on the ring tiles only (the epilogue warps' ring holds its two
# pre-activations).
_DENSE_TILES = tiles.keys(tiles.DENSE_TILES)
_NARROW_TILES = tiles.keys(tiles.DENSE_NARROW_TILES)
_RING_TILES = tiles.keys(tiles.DENSE_RING_TILES)
# Fewer rows leave the gated gradient to XLA (its dot, then one fusion): with a few 128 x 256
# tiles per SM the epilogue warps' pass is not hidden; the fused form first led at 512 rows
# (bench_epilogues swiglu_grad, H100: docs/notebook/2026-11-29-tile-registry-figures.md).
GATED_GRADIENT_MIN_ROWS = 512
DENSE_CONFIGS: tuple[GemmConfig, ...] = tuple(GemmConfig(*t) for t in _DENSE_TILES)


def configs_for(kind: str, activation: str | None) -> tuple[GemmConfig, ...]:
    """The configurations compiled for the `kind` fusion with `activation` (none: XLA's)."""
    if kind == GATED_GRADIENT:  # not with the exact GELU (its erff spilled there): XLA's
        return () if activation == "gelu_erf" else tuple(
            c for c in DENSE_CONFIGS if c.tile in _RING_TILES)
    narrow_only = kind == FORWARD and activation == "gelu_erf"
    return tuple(c for c in DENSE_CONFIGS if not narrow_only or c.tile in _NARROW_TILES)


def default_config(kind: str, activation, m: int, n: int, k: int,
                   num_sms: int | None = None) -> GemmConfig:
    """The compiled fused tile with the least estimated time (the dense GEMM's cost model,
    ops/gemm/config.estimate_seconds; a gated product is 2n accumulator columns wide)."""
    num_sms = device.num_sms() if num_sms is None else num_sms
    acc_n = 2 * n if kind == GATED else n
    candidates = (dataclasses.replace(cfg, stream_k=stream_k)
                  for cfg in configs_for(kind, activation)
                  for stream_k in ((False, True) if cfg.takes_stream_k else (False,))
                  if not (stream_k and m < cfg.block_m))
    return fastest(candidates,
                   lambda c: estimate_seconds(c, m, acc_n, k, num_sms,
                                              dram_bytes_per_s=device.dram_bytes_per_s(),
                                              l2_bytes=device.l2_bytes()),
                   lambda c: (-c.stages, -c.cluster_m, int(c.stream_k)))


_OP_OF_KIND = {FORWARD: "dense", GRADIENT: "dense", GATED: "gated_dense",
               GATED_GRADIENT: "gated_mlp"}


def check_config(config, kind: str, activation) -> GemmConfig:
    """`config` (a GemmConfig) if the `kind` fusion with `activation` is compiled with it; else
    a ValueError naming the choices."""
    op = _OP_OF_KIND[kind]
    config = GemmConfig.coerce(config, f"jax_tma.{op}")
    return require_among(config, configs_for(kind, activation), op,
                         f"the {kind} fusion with activation {activation!r}", split_k=1)
