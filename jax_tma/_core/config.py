"""Tile configurations of the kernels: one frozen base class, validated once when built, and the
argmin over estimated seconds that every op's heuristic (``default_config``) runs.

A configuration names one compiled tile (block_m, block_n, stages, cluster_m: a TileConfig
instantiation of csrc/kernels/) plus a split-K factor. Each op's subclass says which tiles are
compiled for it (``TILES``), how many K ranges it may split into (``MAX_SPLIT_K``) and how deep
one K slice is (``BLOCK_K``); what depends on the product (whether a configuration can compute
it) is the op's own check at call time.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable, ClassVar, Iterable, TypeVar

import numpy as np

Tile = tuple[int, int, int, int]  # (block_m, block_n, stages, cluster_m)
C = TypeVar("C")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One compiled tile of a kernel with a split-K factor (the fields every kernel shares).

    Attributes:
      block_m, block_n: rows and columns of the CTA tile.
      stages: depth of the TMA -> wgmma shared-memory ring (K slices of ``BLOCK_K``).
      cluster_m: CTAs per cluster along M (2: vertically adjacent tiles multicast B).
      split_k: how many K ranges the product is split into (1: none), each computed apart as
        an fp32 partial product; at most this many are used, so that none is empty.
    """

    block_m: int = 128
    block_n: int = 256
    stages: int = 3
    cluster_m: int = 2
    split_k: int = 1

    # Set by each op's subclass.
    TILES: ClassVar[tuple[Tile, ...]] = ()
    MAX_SPLIT_K: ClassVar[int] = 1
    BLOCK_K: ClassVar[int] = 64
    # How the tile error names what the tiles are ("a compiled configuration").
    TILE_NOUN: ClassVar[str] = "compiled configuration"

    def __post_init__(self) -> None:
        # Integers of any kind (numpy's too) are stored as int; bools and floats are refused.
        for name in ("block_m", "block_n", "stages", "cluster_m", "split_k"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                raise ValueError(
                    f"jax_tma: {type(self).__name__} {name} must be an int, got {value!r} "
                    f"({type(value).__name__})"
                )
            object.__setattr__(self, name, int(value))
        if self.tile not in self.TILES:
            choices = "; ".join(f"block_m={bm}, block_n={bn}, stages={st}, cluster_m={cm}"
                                for bm, bn, st, cm in self.TILES)
            raise ValueError(f"jax_tma: {type(self).__name__}({self.describe()}) is not a "
                             f"{self.TILE_NOUN}; choose one of: {choices}")
        if not 1 <= self.split_k <= self.MAX_SPLIT_K:
            raise ValueError(f"jax_tma: {type(self).__name__} split_k must be an int in "
                             f"[1, {self.MAX_SPLIT_K}], got {self.split_k!r}")

    @property
    def tile(self) -> Tile:
        return (self.block_m, self.block_n, self.stages, self.cluster_m)

    def splits_for(self, k: int) -> int:
        """K ranges actually used for a depth of k: at most split_k, none of them empty."""
        k_blocks = -(-k // self.BLOCK_K)
        per_split = -(-k_blocks // min(self.split_k, k_blocks))
        return -(-k_blocks // per_split)

    def describe(self) -> str:
        return (f"block_m={self.block_m}, block_n={self.block_n}, stages={self.stages}, "
                f"cluster_m={self.cluster_m}, split_k={self.split_k}")

    @classmethod
    def coerce(cls, config, op: str):
        """`config` as this class. One of another copy of the class (made before
        ``importlib.reload`` of its module) is rebuilt from its fields, and checked again."""
        if config is None or isinstance(config, cls):
            return config
        names = [f.name for f in dataclasses.fields(cls)]
        if (type(config).__name__ == cls.__name__ and dataclasses.is_dataclass(config)
                and [f.name for f in dataclasses.fields(config)] == names):
            return cls(**{name: getattr(config, name) for name in names})
        raise TypeError(f"{op}: config must be a jax_tma.{cls.__name__} or None, got {config!r}")


# Stream-K (scheduler/tile_scheduler.cuh, TileScheduler::make_params): the workspace's flags, one
# per consumer warpgroup (sm90_gemm::kStreamKSlotsPerCta), and the fewest K slices per CTA.
STREAM_K_SLOTS_PER_CTA = 2
STREAM_K_MIN_SLICES = 4


def stream_k_share(tiles: int, k_blocks: int, num_sms: int) -> tuple[int, int] | None:
    """(tiles left after the whole waves, CTAs that share their K slices) when stream-K
    applies to `tiles` tiles of `k_blocks` K slices on `num_sms` CTAs, else None
    (TileScheduler::make_params)."""
    left = tiles % num_sms
    iterations = left * k_blocks
    ctas = min(num_sms, iterations // STREAM_K_MIN_SLICES)
    if left and ctas > left and iterations <= (2**31 - 1) // 2:
        return left, ctas
    return None


@dataclasses.dataclass(frozen=True)
class StreamKConfig(TileConfig):
    """A tile configuration of a kernel that also runs stream-K (the dense GEMM's and the FP8
    product's: scheduler/tile_scheduler.cuh).

    Attributes:
      stream_k: when the tiles do not fill the last wave of the grid, deal that wave's K slices
        out evenly to every CTA (128-row tiles, cluster_m=1, split_k=1 only). CTAs that compute
        part of a tile leave fp32 partial sums in a workspace for the CTA that computes the
        tile's first slices, which adds them in a fixed order (deterministic) before storing.
        Applies only where each CTA gets at least 4 slices and more CTAs get work than whole
        tiles would give; otherwise the tiles run whole.
    """

    stream_k: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stream_k, np.bool_):
            object.__setattr__(self, "stream_k", bool(self.stream_k))
        super().__post_init__()
        if not isinstance(self.stream_k, bool):
            raise ValueError(f"jax_tma: {type(self).__name__} stream_k must be a bool, got "
                             f"{self.stream_k!r}")
        if self.stream_k and not (self.takes_stream_k and self.split_k == 1):
            raise ValueError(
                f"jax_tma: {type(self).__name__}({self.describe()}): stream_k needs block_m=128, "
                "cluster_m=1 and split_k=1")

    @property
    def takes_stream_k(self) -> bool:
        """Whether this tile can run stream-K (TileConfig::kStreamK: 128 rows, no cluster)."""
        return self.block_m == 128 and self.cluster_m == 1

    def describe(self) -> str:
        return super().describe() + (", stream_k=True" if self.stream_k else "")

    def stream_k_applies(self, tiles: int, k: int, num_sms: int) -> tuple[int, int] | None:
        """stream_k_share of `tiles` tiles of depth k where this configuration runs stream-K,
        else None."""
        return stream_k_share(tiles, -(-k // self.BLOCK_K), num_sms) if self.stream_k else None

    def stream_k_workspace_bytes(self, num_sms: int) -> int:
        """Bytes of the stream-K workspace for a grid of `num_sms` CTAs (0 without stream-K):
        a flag per consumer warpgroup padded to 256 bytes, then an fp32 tile per CTA
        (sm90_gemm::stream_k_workspace_bytes)."""
        if not self.stream_k:
            return 0
        flag_bytes = -(-num_sms * STREAM_K_SLOTS_PER_CTA * 4 // 256) * 256
        return flag_bytes + num_sms * self.block_m * self.block_n * 4


def stream_k_variants(configs: Iterable[C]) -> list[C]:
    """Those of `configs` (StreamKConfig) whose tile takes stream-K, with it on."""
    return [dataclasses.replace(c, stream_k=True) for c in configs if c.takes_stream_k]


def require_among(config: TileConfig, allowed: Iterable[TileConfig], op: str, what: str,
                  **fixed) -> TileConfig:
    """`config` when its tile is one of `allowed`'s and each field named in `fixed` has that
    value; else a ValueError naming `what` (the fusion or product the tiles are compiled for)
    and the choices."""
    allowed = tuple(allowed)
    if (config.tile not in {c.tile for c in allowed}
            or any(getattr(config, name) != value for name, value in fixed.items())):
        choices = "; ".join(c.describe() for c in allowed)
        raise ValueError(f"jax_tma.{op}: {type(config).__name__}({config.describe()}) is not "
                         f"compiled for {what}; choose one of: {choices}")
    return config


def _order(seconds: Callable[[C], float], tiebreak: Callable[[C], tuple], digits: int):
    """The sort key of ``ranked`` and ``fastest``: estimated seconds rounded to `digits` (so that
    estimates equal up to noise fall to `tiebreak`), then the tiebreak."""
    return lambda c: (round(seconds(c), digits), *tiebreak(c))


def ranked(candidates: Iterable[C], seconds: Callable[[C], float],
           tiebreak: Callable[[C], tuple] = lambda c: (), digits: int = 9) -> list[C]:
    """`candidates` by estimated `seconds`, fastest first (see ``_order``); equal keys keep the
    candidates' order."""
    return sorted(candidates, key=_order(seconds, tiebreak, digits))


def fastest(candidates: Iterable[C], seconds: Callable[[C], float],
            tiebreak: Callable[[C], tuple] = lambda c: (), digits: int = 9) -> C | None:
    """The first of ``ranked(...)``: None where there are no candidates."""
    return min(candidates, key=_order(seconds, tiebreak, digits), default=None)
