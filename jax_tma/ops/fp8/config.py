"""Configurations of the sm90 FP8 kernel (csrc/contract/sm90_fp8.h): the compiled tiles, the
types it reads and writes, and the heuristic that picks a tile and split-K factor.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jax_tma._core import device, tiles
from jax_tma._core.config import Tile, TileConfig, fastest

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# K slices (and the block scales' blocks) are 128 deep.
SCALE_BLOCK = 128
# (block_m, block_n, stages, cluster_m) of the compiled FP8 tiles, and of Fp8UnpromotedTile,
# compiled without promotion for e4m3 with fp32 output only (the tile registry,
# jax_tma/_core/tiles.py).
_FP8_TILES = tiles.keys(tiles.FP8_TILES)
_UNPROMOTED_TILE = tiles.FP8_UNPROMOTED[0].key
MAX_SPLIT_K = 8


@dataclasses.dataclass(frozen=True)
class Fp8Config(TileConfig):
    """One compiled tile of the FP8 kernel, with a split-K factor.

    Attributes:
      block_m, block_n: the CTA tile (128-row tiles: two consumer warpgroups of 64 rows; 64-row
        tiles: ping-pong). stages: depth of the ring of 128-deep K slices. cluster_m: 2 pairs
        vertically adjacent tiles that multicast B.
      split_k: K ranges computed apart as fp32 partial products and summed by XLA (for products
        with few output tiles and a long K).
    """

    TILES: ClassVar[tuple[Tile, ...]] = _FP8_TILES
    MAX_SPLIT_K: ClassVar[int] = MAX_SPLIT_K
    BLOCK_K: ClassVar[int] = SCALE_BLOCK
    TILE_NOUN: ClassVar[str] = "compiled FP8 tile"


FP8_CONFIGS: tuple[Fp8Config, ...] = tuple(Fp8Config(*t) for t in _FP8_TILES)

# Cost model: relative wgmma throughput per tile (128 x 256 the best), the chip's FP8 rate.
_TILE_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.9, (64, 256): 0.8, (64, 128): 0.7}
_PEAK_FLOPS = 1.979e15


def estimate_seconds(cfg: Fp8Config, m: int, n: int, k: int, num_sms: int,
                     dram_bytes_per_s: float) -> float:
    """A rough time of one product on `cfg`: waves of tiles at the tile's rate, or the operand
    and output bytes at DRAM speed, whichever is longer; split-K adds its fp32 partial products'
    round trip through memory and XLA's sum after the kernel."""
    m_blocks, n_blocks = -(-m // cfg.block_m), -(-n // cfg.block_n)
    splits = cfg.splits_for(k)
    units = m_blocks * n_blocks * splits
    waves = -(-units // num_sms)
    per_unit = 2.0 * cfg.block_m * cfg.block_n * -(-k // splits) / (
        _PEAK_FLOPS / num_sms * _TILE_EFFICIENCY[(cfg.block_m, cfg.block_n)])
    seconds = max(waves * per_unit, (m * k + n * k + 2 * m * n) / dram_bytes_per_s)
    if splits > 1:
        seconds += (8 * splits + 2) * m * n / dram_bytes_per_s + 3e-6
    return seconds


def default_config(m: int, n: int, k: int, num_sms: int | None = None) -> Fp8Config:
    """The compiled tile and split with the least estimated time (ties: no split, the larger
    tile). Split-K is considered only where the tiles fill less than one wave."""
    num_sms = device.num_sms() if num_sms is None else num_sms

    def candidates():
        for tile in _FP8_TILES:
            if tile[3] > 1 and -(-m // tile[0]) < 2:
                continue  # a pair needs two row blocks
            tiles = -(-m // tile[0]) * -(-n // tile[1])
            for split in (1, 2, 4, 8) if tiles < num_sms else (1,):
                cfg = Fp8Config(*tile, split_k=split)
                if cfg.splits_for(k) == split:
                    yield cfg

    return fastest(candidates(),
                   lambda cfg: estimate_seconds(cfg, m, n, k, num_sms,
                                                device.dram_bytes_per_s()),
                   lambda cfg: (cfg.split_k, -cfg.block_m * cfg.block_n, -cfg.cluster_m),
                   digits=8)
