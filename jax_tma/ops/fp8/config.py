"""Configurations of the sm90 FP8 kernel (csrc/contract/sm90_fp8.h): the compiled tiles, the
types it reads and writes, and the heuristic that picks a tile and split-K factor.

The heuristic is a cost model a reader can check by hand: a product of M x N x K on a tile of
block_m x block_n makes ceil(M / block_m) * ceil(N / block_n) work tiles, run in waves of one
per SM; every wave costs as much as a full one (the last wave's idle SMs are the loss that
non-power-of-two widths such as 192 avoid), each tile at its measured share of the chip's FP8
rate; the result is at least the operands' and the output's bytes at DRAM speed. Split-K is
considered only where the tiles fill less than one wave. Stream-K (128-row tiles without a
cluster) is considered only where the tiles fill at least one whole wave: it then replaces the
part-empty last wave by an even share of its K slices, at a fixed cost of part of a wave; on
fewer tiles it cuts K into many short pieces, which split-K does better (docs/fp8.md).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jax_tma._core import device, tiles
from jax_tma._core.config import (StreamKConfig, Tile, fastest, ranked, require_among,
                                  stream_k_variants)

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# K slices (and the block scales' blocks) are 128 deep.
SCALE_BLOCK = 128
# (block_m, block_n, stages, cluster_m) of the compiled FP8 tiles: with promotion, and with the
# tensor core's accumulation (fast; a subset of the former) (the tile registry,
# jax_tma/_core/tiles.py).
_FP8_TILES = tiles.keys(tiles.FP8_TILES)
_FAST_TILES = tiles.keys(tiles.FP8_FAST_TILES)
MAX_SPLIT_K = 8


@dataclasses.dataclass(frozen=True)
class Fp8Config(StreamKConfig):
    """One compiled tile of the FP8 kernel, with a split-K factor or stream-K.

    Attributes:
      block_m, block_n: the CTA tile (128-row tiles: two consumer warpgroups of 64 rows; 64-row
        tiles: ping-pong). stages: depth of the ring of 128-deep K slices. cluster_m: 2 pairs
        vertically adjacent tiles that multicast B.
      split_k: K ranges computed apart as fp32 partial products and summed by XLA (for products
        with few output tiles and a long K).
      stream_k: the last wave's K slices dealt out to every CTA, the pieces' fp32 partial sums
        (promoted and scaled) added by the CTA that starts each tile, in a fixed order
        (128-row tiles with cluster_m=1, split_k=1; see StreamKConfig).
    """

    TILES: ClassVar[tuple[Tile, ...]] = _FP8_TILES
    MAX_SPLIT_K: ClassVar[int] = MAX_SPLIT_K
    BLOCK_K: ClassVar[int] = SCALE_BLOCK
    TILE_NOUN: ClassVar[str] = "compiled FP8 tile"


FP8_CONFIGS: tuple[Fp8Config, ...] = tuple(Fp8Config(*t) for t in _FP8_TILES)
FP8_FAST_CONFIGS: tuple[Fp8Config, ...] = tuple(Fp8Config(*t) for t in _FAST_TILES)

# Cost model: each tile's sustained share of the chip's FP8 rate on products of many waves,
# promoted (per-tensor and block-scaled alike) and fast: the time of one wave of full tiles at
# 8192^3 on an H200 (bench_fp8.py --sweep, per-tensor; docs/notebook/2026-11-29-fp8-cross.md;
# the tiles without a cluster relative to their pairs in a later sweep,
# docs/notebook/2026-11-29-fp8-tile-and-fine-table.md); the fast 128 x 192 pairs' relative to
# the fast 128 x 256 pairs' on two other products (docs/notebook/2026-11-29-fp8-probe.md).
# Keyed by (block_m, block_n, cluster_m).
_TILE_EFFICIENCY = {(128, 256, 2): 0.66, (128, 256, 1): 0.636, (128, 192, 2): 0.725,
                    (128, 192, 1): 0.744, (128, 144, 2): 0.61, (128, 128, 2): 0.601,
                    (128, 128, 1): 0.636, (64, 128, 1): 0.52}
_FAST_EFFICIENCY = {(128, 256, 2): 0.80, (128, 192, 2): 0.775, (128, 128, 1): 0.75}
# Stream-K's cost beyond its share of the last wave's K slices, in waves: the partial tiles'
# round trip through the workspace and the fixup (fitted to 128 x 192 tiles on products of
# 4096-8192 rows; docs/fp8.md).
_STREAM_K_EXTRA_WAVES = 0.45
# A compiled tile without a rate is selectable with config=, timed by bench_fp8.py --sweep and
# fp8_autotune, but not a heuristic candidate until it is measured.
_PEAK_FLOPS = 1.979e15


def rate_key(tile) -> tuple[int, int, int]:
    """A tile's (block_m, block_n, cluster_m): the key of its measured rate."""
    return tile[0], tile[1], tile[3]


def estimate_seconds(cfg: Fp8Config, m: int, n: int, k: int, num_sms: int,
                     dram_bytes_per_s: float, fast: bool = False) -> float:
    """A rough time of one product on `cfg`: waves of tiles at the tile's rate, or the operand
    and output bytes at DRAM speed, whichever is longer; split-K adds its fp32 partial products'
    round trip through memory and XLA's sum after the kernel; stream-K replaces the last wave by
    its share of that wave's K slices plus _STREAM_K_EXTRA_WAVES."""
    m_blocks, n_blocks = -(-m // cfg.block_m), -(-n // cfg.block_n)
    splits = cfg.splits_for(k)
    units = m_blocks * n_blocks * splits
    waves = -(-units // num_sms)
    share = cfg.stream_k_applies(units, k, num_sms)
    if share is not None:
        left, ctas = share
        waves = units // num_sms + left / ctas + _STREAM_K_EXTRA_WAVES
    efficiency = (_FAST_EFFICIENCY if fast else _TILE_EFFICIENCY)[rate_key(cfg.tile)]
    per_unit = 2.0 * cfg.block_m * cfg.block_n * -(-k // splits) / (
        _PEAK_FLOPS / num_sms * efficiency)
    seconds = max(waves * per_unit, (m * k + n * k + 2 * m * n) / dram_bytes_per_s)
    if splits > 1:
        seconds += (8 * splits + 2) * m * n / dram_bytes_per_s + 3e-6
    return seconds


def cluster_fits(block_m: int, cluster_m: int, m: int) -> bool:
    """Whether a tile's cluster has rows for each of its CTAs: a pair needs two row blocks."""
    return cluster_m == 1 or -(-m // block_m) >= 2


def ranked_configs(m: int, n: int, k: int, num_sms: int | None = None, fast: bool = False,
                   measured_only: bool = True) -> list[Fp8Config]:
    """The compiled tiles with promotion (or, `fast`, for the tensor core's accumulation) that
    fit the product, with the split-K factors worth trying (only where the tiles fill less than
    one wave) and stream-K (only where they fill at least one), by estimated time, fastest first
    (ties: whole tiles, no split, the larger tile). Tiles without a measured rate, and stream-K
    on fewer tiles than SMs, are left out, or with `measured_only=False` ranked last
    (fp8_autotune times them too)."""
    num_sms = device.num_sms() if num_sms is None else num_sms
    efficiency = _FAST_EFFICIENCY if fast else _TILE_EFFICIENCY

    def scored(cfg: Fp8Config) -> bool:
        """Whether the model rates `cfg`: a measured tile, on stream-K only where its tiles
        fill at least one wave."""
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        return rate_key(cfg.tile) in efficiency and not (cfg.stream_k and tiles < num_sms)

    def candidates():
        for tile in _FAST_TILES if fast else _FP8_TILES:
            if not cluster_fits(tile[0], tile[3], m):
                continue
            tiles = -(-m // tile[0]) * -(-n // tile[1])
            for split in (1, 2, 4, 8) if tiles < num_sms else (1,):
                cfg = Fp8Config(*tile, split_k=split)
                if cfg.splits_for(k) == split:
                    yield cfg
            for streamed in stream_k_variants([Fp8Config(*tile)]):
                if streamed.stream_k_applies(tiles, k, num_sms):
                    yield streamed

    def seconds(cfg: Fp8Config) -> float:
        if not scored(cfg):
            return float("inf")
        return estimate_seconds(cfg, m, n, k, num_sms, device.dram_bytes_per_s(), fast)

    return ranked((c for c in candidates() if scored(c) or not measured_only), seconds,
                  lambda cfg: (cfg.stream_k, cfg.split_k, -cfg.block_m * cfg.block_n,
                               -cfg.cluster_m),
                  digits=8)


def default_config(m: int, n: int, k: int, num_sms: int | None = None,
                   fast: bool = False) -> Fp8Config:
    """The heuristic's configuration: the first of ranked_configs."""
    return ranked_configs(m, n, k, num_sms, fast)[0]


# The grouped (ragged) FP8 product (fp8_ragged_dot): its compiled tiles, promoted, no split-K.
FP8_RAGGED_CONFIGS: tuple[Fp8Config, ...] = tuple(
    Fp8Config(*t) for t in tiles.keys(tiles.FP8_RAGGED_TILES))


def check_ragged_config(config: Fp8Config) -> Fp8Config:
    """`config` if the FP8 ragged kernel is compiled with it; else a ValueError naming the
    choices."""
    return require_among(config, FP8_RAGGED_CONFIGS, "fp8_ragged_dot", "FP8 ragged products",
                         split_k=1, stream_k=False)


def default_ragged_config(rows: int, n: int, k: int, groups: int,
                          num_sms: int | None = None) -> Fp8Config:
    """The compiled FP8 ragged tile with the least estimated time, groups assumed of equal size:
    the dense FP8 model (estimate_seconds) over the row blocks the groups round up to (each
    group's last block is whole work for a partial one); ties go to the larger tile."""
    num_sms = device.num_sms() if num_sms is None else num_sms
    per_group = max(1, -(-rows // groups))

    def seconds(cfg: Fp8Config) -> float:
        blocks = groups * -(-per_group // cfg.block_m)
        return estimate_seconds(cfg, blocks * cfg.block_m, n, k, num_sms,
                                device.dram_bytes_per_s())

    return fastest((c for c in FP8_RAGGED_CONFIGS if cluster_fits(c.block_m, c.cluster_m, rows)),
                   seconds, lambda cfg: (-cfg.block_m * cfg.block_n, -cfg.cluster_m), digits=8)
