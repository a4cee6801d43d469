"""Configurations of the sm90 GEMM kernel and the heuristic that picks one.

``GemmConfig`` names one compiled tile configuration (jax_tma/_core/tiles.py) plus a split-K
factor; ``check_config`` says whether it can compute a given product; ``default_config`` scores
every legal configuration with a cost model fitted to measurements (``estimate_seconds``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp

from jax_tma._core import tiles
from jax_tma._core.config import StreamKConfig, Tile, ranked
from jax_tma._core.device import (  # noqa: F401 - the heuristics' defaults
    DEFAULT_DRAM_BYTES_PER_S,
    DEFAULT_L2_BYTES,
    DEFAULT_NUM_SMS,
)

KERNEL_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# TMA needs 16-byte global strides: every stride of an operand except its unit one is a
# multiple of this many 16-bit elements (the lowering pads an operand's rows when not).
STRIDE_ELEMS = 8
# Rows that the lowering pads anyway it pads to 32-byte multiples: rows 16 but not 32 bytes
# apart load at about half speed (see _MISALIGNED_ISSUE_BYTES_PER_S).
PAD_ELEMS = 16
BLOCK_K = 64
# (block_m, block_n, stages, cluster_m, has a direct-store variant) of the TileConfig
# instantiations the extension compiles (the tile registry, jax_tma/_core/tiles.py).
_COMPILED_TILES = tiles.gemm_tiles()
_TILE_KEYS = {t[:4]: t[4] for t in _COMPILED_TILES}
MAX_SPLIT_K = 16
# EpilogueKind (csrc/contract/sm90_gemm.h).
_EPILOGUE_TMA_STORE, _EPILOGUE_DIRECT = 0, 1

# Sizes the kernel takes, as the FFI handler checks them (csrc/ffi/gemm.cc: gemm_sm90() and
# run()); the lowering sends every other product to XLA, so none fails at run time.
# - m, n, k and batch each in [1, MAX_DIM] (the kernel's shape is int32; TMA's tensor-map
#   dimensions, below 2^32, follow);
MAX_DIM = 2**31 - 1
# - at most MAX_WORK_UNITS (split, batch entry, cluster row of M blocks, N block) units: the
#   scheduler numbers them in int32 and steps past the last by the grid's cluster count;
MAX_WORK_UNITS = (2**31 - 1) // 2
# - every TMA byte stride below 2^40. A stride that steps through a buffer is smaller than the
#   buffer, and the stride of a dimension of extent 1 is the dense one (at most the buffer
#   rounded up to 16 bytes), so buffers of at most this many bytes keep every stride below it.
MAX_BUFFER_BYTES = 2**40 - 16


def kernel_output_dtypes(in_dtype) -> tuple:
    """Output dtypes the kernel writes for inputs of `in_dtype`: the input type or fp32."""
    return (jnp.dtype(in_dtype), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class GemmConfig(StreamKConfig):
    """One compiled configuration of the sm90 GEMM kernel.

    Attributes:
      block_m: rows of the CTA tile: 128 (its two consumer warpgroups take 64 rows each) or 64
        (ping-pong: the two take alternate tiles, one's epilogue under the other's mainloop).
      block_n: columns of the CTA tile.
      stages: depth of the TMA -> wgmma shared-memory ring (K slices of 64).
      cluster_m: CTAs per cluster along M. With 2, the CTAs of a cluster compute vertically
        adjacent tiles and multicast the shared B slice to each other.
      split_k: how many K ranges the product is split into (1: none). Each range writes an fp32
        partial product; the partial products are summed in a fixed order (deterministic).
        At most this many ranges are used, so that none is empty.
      stream_k: the last wave's K slices dealt out to every CTA (StreamKConfig).
    """

    TILES: ClassVar[tuple[Tile, ...]] = tuple(t[:4] for t in _COMPILED_TILES)
    MAX_SPLIT_K: ClassVar[int] = MAX_SPLIT_K
    BLOCK_K: ClassVar[int] = BLOCK_K

    def multicasts(self, m: int) -> bool:
        """Whether the CTAs of a cluster share B's loads (multicast) on M = m: a cluster row
        whose second M block lies past the matrix loads B alone."""
        return self.cluster_m > 1 and math.ceil(m / self.block_m) >= self.cluster_m

    @property
    def has_direct_store(self) -> bool:
        """Whether this tile is also compiled with the epilogue for unaligned output rows."""
        return _TILE_KEYS[self.tile]

    def work_units(self, m: int, n: int, k: int, batch: int = 1) -> int:
        """(split, batch entry, cluster row, N block) units the scheduler numbers for `batch`
        products of M x N x K (the FFI handler's count; at most MAX_WORK_UNITS)."""
        cluster_rows = -(-(-(-m // self.block_m)) // self.cluster_m)
        return cluster_rows * -(-n // self.block_n) * batch * self.splits_for(k)


COMPILED_CONFIGS: tuple[GemmConfig, ...] = tuple(
    GemmConfig(bm, bn, st, cm) for bm, bn, st, cm, _ in _COMPILED_TILES
)


def tma_store_aligned(strides: int | tuple[int, ...], out_dtype) -> bool:
    """Whether output rows `strides` elements apart (an int: the row length of an [M, n]
    output; a tuple: every stride the output's indices step by) are 16-byte multiples, as TMA
    stores need."""
    strides = (strides,) if isinstance(strides, int) else strides
    return all((s * jnp.dtype(out_dtype).itemsize) % 16 == 0 for s in strides)


def check_config(config: GemmConfig, m: int, n: int, k: int, out_dtype,
                 out_strides: tuple[int, ...] | None = None, batch: int = 1) -> None:
    """Raises ValueError when `config` cannot compute `batch` M x N x K products into
    out_dtype: output rows TMA cannot store, or more work units or output bytes than the
    kernel takes (MAX_WORK_UNITS, MAX_BUFFER_BYTES).

    `out_strides`: the element strides between the output's rows (and batch entries), by
    default (n,) for a dense [M, N] output."""
    # Split-K writes fp32 partial products; otherwise the kernel writes out_dtype.
    splits = config.splits_for(k)
    stored = jnp.float32 if splits > 1 else out_dtype
    shape = f"{batch} x ({m}, {n}) output, K={k}" if batch > 1 else f"({m}, {n}) output, K={k}"
    units = config.work_units(m, n, k, batch)
    if units > MAX_WORK_UNITS:
        raise ValueError(
            f"jax_tma: GemmConfig({config.describe()}) cuts a {shape} into {units} work units; "
            f"the kernel's scheduler takes at most {MAX_WORK_UNITS}. Use larger tiles, fewer "
            "splits, or config=None (the heuristic, or XLA where no configuration fits)"
        )
    out_bytes = splits * batch * m * n * jnp.dtype(stored).itemsize
    if out_bytes > MAX_BUFFER_BYTES:
        raise ValueError(
            f"jax_tma: GemmConfig({config.describe()}) writes {out_bytes} bytes for a {shape} "
            f"of {jnp.dtype(stored).name}; TMA strides must stay below 2^40 bytes"
        )
    strides = (n,) if out_strides is None else tuple(out_strides)
    if not tma_store_aligned(strides, stored) and not config.has_direct_store:
        itemsize = jnp.dtype(stored).itemsize
        raise ValueError(
            f"jax_tma: GemmConfig({config.describe()}) stores through TMA, which needs output "
            f"rows of a multiple of 16 bytes; a ({m}, {n}) output of {jnp.dtype(stored).name} "
            f"has rows {', '.join(str(s * itemsize) for s in strides)} bytes apart. Use a tile "
            "compiled with the direct-store epilogue (block_m=64, or block_m=128, block_n=128, "
            "cluster_m=1)"
        )


# Constants of the cost model, fitted to sweeps of every configuration (benchmarks/bench_gemm.py
# --sweep, H200 and H100). The measurements behind each are in docs/cost-model.md.
#
# Relative wgmma throughput of one CTA per tile shape: two consumer warpgroups on a wide tile
# keep the tensor cores busiest; 128 x 232 loads B's last 64-wide block whole for 40 columns.
_TILE_EFFICIENCY = {(128, 256): 1.0, (128, 232): 0.96, (128, 192): 0.97, (128, 128): 0.93,
                    (64, 256): 0.88, (64, 128): 0.84, (64, 64): 0.46}
# A tile in clusters of 2 against the same tile alone, on aligned rows: the pairs' lockstep
# costs 64-row tiles always, and 128 x 128 tiles where more than _NARROW_COLUMN_BLOCKS tiles
# span N; misaligned rows favour the pairs (_MISALIGNED_SMALL_TILE_EFFICIENCY on top).
_CLUSTER_EFFICIENCY = {(64, 256): 0.97, (64, 128): 0.83, (128, 128): 0.93}
_NARROW_COLUMN_BLOCKS = 4
_PEAK_FLOPS_PER_SM = 989e12 / 132
# Every tile also pays for its epilogue and the refill of the ring behind it.
_TILE_FIXED_S = 0.45e-6
# Rows 16 but not 32 bytes apart slow TMA's loads, and 64-row tiles load the most per FLOP:
# misaligned B rows cost about half the speed (a pair multicasting B halves each CTA's share);
# misaligned A rows alone cost a pair more than a CTA that loads all of B.
_MISALIGNED_SMALL_TILE_EFFICIENCY = {"b": {1: 0.5, 2: 0.9}, "a": {1: 1.0, 2: 0.86}}
# Whatever the tile, a CTA issues TMA loads of misaligned rows at about this rate (a block that
# a cluster multicasts counted once, B in whole 64-column boxes).
_MISALIGNED_ISSUE_BYTES_PER_S = 46e9
_BOX_COLS = 64  # a TMA box's row: 128 swizzled bytes of 16-bit elements
# Streaming operands (decode-like shapes): about 65 GB/s per busy CTA, at most this share of
# the device's peak DRAM bandwidth (two transfers per memory clock across the bus, as the driver
# reports them). A split-K product pays _SPLIT_FIXED_S for the extra reduction kernel.
_STREAMING_SHARE_OF_PEAK = 0.83
_MEMORY_BYTES_PER_S_PER_CTA = 65e9
# While every SM streams, TMA brings at most about this rate of operand tiles into one SM: it
# keeps wide tiles on products whose operand traffic bounds every choice.
_SM_LOAD_BYTES_PER_S = 115e9
_SPLIT_FIXED_S = 2e-6
# Share of the shorter of the compute and memory times that does not hide under the longer.
_OVERLAP_LOSS = 0.01
_SPLIT_CHOICES = (1, 2, 4, 8, 16)  # measured: split 3 lost to 4 on 1x4096x4096
# Stream-K's share of the last wave costs this many tiles' time on top of its K slices: the
# pieces' partial sums' round trip, and K ranges that no longer line up across the CTAs that
# share operands.
_STREAM_K_EXTRA_TILES = 0.33
# ...and, on products of fewer than _STREAM_K_FIXED_WAVES whole waves, this once: the flags'
# memset before the kernel and the pieces' fixup (partial tiles through the workspace, the
# owner's wait for them): on H100 sweeps of products the random suite lost, stream-K ran a few
# microseconds over the estimate beyond what the same tile without it did; on many waves the
# model's stream-K share is pessimistic by more than that, so the charge stops there (the
# figures: docs/cost-model.md).
_STREAM_K_FIXED_S = 4e-6
_STREAM_K_FIXED_WAVES = 4
# The tile order in which stream_k_shared_operand_bytes counts the blocks that stream-K's tiles
# share: groups of 8 cluster rows sweeping the N blocks, TileScheduler's order when
# _STREAM_K_REREAD was fitted. Since 79d19c5 the scheduler's groups follow the tile and the grid
# (TileScheduler::group_rows_for: 16 rows for 128 x 256 stream-K on 132 SMs); counted in that
# order, a few picks over the docs/cost-model.md suite would move from pairs to stream-K, among
# them products the fit measured pairs faster on, so the charge keeps the order it was fitted on
# until it is refitted (docs/cost-model.md).
_GROUP_M = 8
# Stream-K's CTAs start their ranges at scattered K offsets, so the last tiles that share a row
# block of A or a column block of B read it at different times: what of those shared blocks L2
# cannot hold is read again from memory, charged at this many times the excess at streaming
# bandwidth.
_STREAM_K_REREAD = 1.5


def stream_k_shared_operand_bytes(config: GemmConfig, m: int, n: int, k: int, batch: int = 1,
                                  num_sms: int = DEFAULT_NUM_SMS, in_bytes: int = 2) -> int:
    """Bytes of the operand blocks that two or more of stream-K's tiles read: the row blocks of
    A and column blocks of B shared among the tiles left after the whole waves, in groups of
    _GROUP_M rows (0 where stream-K does not apply)."""
    m_blocks, n_blocks = math.ceil(m / config.block_m), math.ceil(n / config.block_n)
    per_batch = m_blocks * n_blocks
    tiles = batch * per_batch
    if config.stream_k_applies(tiles, k, num_sms) is None:
        return 0
    row_uses: collections.Counter = collections.Counter()  # (batch entry, block) -> tiles
    col_uses: collections.Counter = collections.Counter()
    for unit in range(tiles - tiles % num_sms, tiles):
        entry, tile = divmod(unit, per_batch)
        group, in_group = divmod(tile, _GROUP_M * n_blocks)
        first_row = group * _GROUP_M
        n_block, row = divmod(in_group, min(_GROUP_M, m_blocks - first_row))
        row_uses[entry, first_row + row] += 1
        col_uses[entry, n_block] += 1
    shared_rows = sum(uses > 1 for uses in row_uses.values()) * config.block_m
    shared_cols = sum(uses > 1 for uses in col_uses.values()) * config.block_n
    return (shared_rows + shared_cols) * k * in_bytes


def estimate_seconds(config: GemmConfig, m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS,
                     out_bytes: int = 2, batch: int = 1, misaligned_rows: str = "",
                     dram_bytes_per_s: float = DEFAULT_DRAM_BYTES_PER_S,
                     l2_bytes: int = DEFAULT_L2_BYTES) -> float:
    """Cost model behind default_config, from three times:

    - compute: waves of CTA slots times the time of one tile (its K range at the tile shape's
      wgmma efficiency, plus a fixed cost per tile). A cluster of 2 takes two slots even when
      the matrix ends after its first M block;
    - memory: the operands' traffic at the bandwidth the busy CTAs can pull;
    - loads: each CTA's operand tiles at the rate TMA brings them into one SM, and the
      misaligned rows among them at the slower rate TMA issues those.

    The estimate is the longest of the three plus a small share of the shorter of compute and
    memory (they overlap only in part: among memory-bound choices, the one that computes least
    won the sweeps), plus the split-K partial products' round trip through memory. Stream-K
    replaces the last wave by its share of the K slices plus a fixed cost, and pays for the
    operand blocks its tiles share beyond what L2 holds (stream_k_shared_operand_bytes) and,
    on fewer than _STREAM_K_FIXED_WAVES whole waves, its memset and fixup (_STREAM_K_FIXED_S).
    `batch` independent products of M x N x K share the grid; `misaligned_rows`: the operands,
    "a" and/or "b", whose rows are not 32-byte multiples apart (GemmPlan.misaligned_rows);
    `dram_bytes_per_s`: the device's peak DRAM bandwidth; `l2_bytes`: its L2 cache."""
    splits = config.splits_for(k)
    m_blocks = math.ceil(m / config.block_m)
    tiles = batch * m_blocks * math.ceil(n / config.block_n) * splits
    slots = tiles // m_blocks * math.ceil(m_blocks / config.cluster_m) * config.cluster_m
    waves = math.ceil(slots / num_sms)
    k_per_split = math.ceil(math.ceil(k / BLOCK_K) / splits) * BLOCK_K
    efficiency = _TILE_EFFICIENCY[(config.block_m, config.block_n)]
    wide_aligned = (not misaligned_rows
                    and math.ceil(n / config.block_n) > _NARROW_COLUMN_BLOCKS)
    if config.cluster_m > 1 and (config.block_m == 64 or wide_aligned):
        efficiency *= _CLUSTER_EFFICIENCY.get((config.block_m, config.block_n), 1.0)
    if misaligned_rows and config.block_m == 64:
        worst = "b" if "b" in misaligned_rows else "a"
        efficiency *= _MISALIGNED_SMALL_TILE_EFFICIENCY[worst][config.cluster_m]
    tile_s = (2 * config.block_m * config.block_n * k_per_split) / (
        _PEAK_FLOPS_PER_SM * efficiency
    ) + _TILE_FIXED_S
    streaming = _STREAMING_SHARE_OF_PEAK * dram_bytes_per_s
    busy = min(slots, num_sms) * tiles / slots
    bandwidth = min(streaming, busy * _MEMORY_BYTES_PER_S_PER_CTA)
    memory_s = batch * (2 * (m * k + k * n) + out_bytes * m * n) / bandwidth
    split_s = 0.0 if splits == 1 else _SPLIT_FIXED_S + 8 * splits * batch * m * n / streaming
    share = config.stream_k_applies(tiles, k, num_sms)
    stream_k_s = 0.0  # stream-K's re-reads of shared operand blocks, and its fixed cost
    if share is not None:
        left, ctas = share
        waves = tiles // num_sms + left / ctas + _STREAM_K_EXTRA_TILES
        shared = stream_k_shared_operand_bytes(config, m, n, k, batch, num_sms)
        stream_k_s = _STREAM_K_REREAD * max(0, shared - l2_bytes) / streaming
        if tiles // num_sms < _STREAM_K_FIXED_WAVES:
            stream_k_s += _STREAM_K_FIXED_S
    compute_s = waves * tile_s
    load_s = waves * 2 * (config.block_m + config.block_n) * k_per_split / _SM_LOAD_BYTES_PER_S
    # The misaligned rows each CTA issues per K range (none past the matrix): its A block, and
    # its share of B's boxes.
    sharing = config.cluster_m if config.multicasts(m) else 1
    misaligned = (("a" in misaligned_rows) * min(config.block_m, m)
                  + ("b" in misaligned_rows)
                  * min(math.ceil(config.block_n / _BOX_COLS), math.ceil(n / _BOX_COLS))
                  * _BOX_COLS / sharing)
    misaligned_s = waves * 2 * misaligned * k_per_split / _MISALIGNED_ISSUE_BYTES_PER_S
    return (max(compute_s, load_s, memory_s, misaligned_s)
            + _OVERLAP_LOSS * min(compute_s, memory_s) + split_s + stream_k_s)


# Products the kernel could compute but that run on XLA's dot (gemm.kernel_route; a config
# passed by the caller still runs the kernel). From the 200-product random suite on an H100
# (bench_gemm --random 200 --seed 3, docs/benchmarks.md):
# - K below one K block: the tensor cores multiply zeros for most of the only block and the
#   product is an outer product bound by its output; every such product ran slower.
MIN_KERNEL_K = BLOCK_K
# - outputs narrower than 16 columns (a matrix-vector product, to XLA): the narrowest tile is 64
#   columns; all but one such product ran slower.
MIN_KERNEL_N = 16
# - short K over many outputs: with K <= SHORT_K a tile's time is the fill of its one or two K
#   blocks and its epilogue, which cuBLAS does faster: with 2^24 or more outputs (batch x M x N)
#   all such products of the committed runs but one ran slower; below that they range both
#   ways with no size that separates them, and stay on the kernel (docs/cost-model.md).
SHORT_K = 128
SHORT_K_OUTPUTS = 1 << 24
# - copies that cost more than the product: each operand the lowering pads (rows not 16-byte
#   multiples) or transposes is read and written once more, by one more kernel (about 1 us
#   each on small products: docs/cost-model.md).
_COPY_FIXED_S = 1.0e-6


def copy_seconds(copies: int, copied_bytes: int,
                 dram_bytes_per_s: float = DEFAULT_DRAM_BYTES_PER_S) -> float:
    """Time of `copies` operand copies (pads or transposes) of `copied_bytes` in all."""
    streaming = _STREAMING_SHARE_OF_PEAK * dram_bytes_per_s
    return copies * _COPY_FIXED_S + 2 * copied_bytes / streaming


def xla_reason(m: int, n: int, k: int, kernel_s: float, copy_s: float = 0.0,
               batch: int = 1) -> str | None:
    """Why XLA's dot beats the kernel on `batch` M x N x K products, or None where the kernel
    runs: K shorter than one K block, N narrower than MIN_KERNEL_N, K <= SHORT_K over
    SHORT_K_OUTPUTS or more outputs, or operand copies (`copy_s`, copy_seconds) slower than the
    kernel's estimate (`kernel_s`, estimate_seconds)."""
    if k < MIN_KERNEL_K:
        return f"K={k} is shorter than one {MIN_KERNEL_K}-deep K block"
    if n < MIN_KERNEL_N:
        return f"N={n} is narrower than {MIN_KERNEL_N} columns (a matrix-vector product)"
    if k <= SHORT_K and batch * m * n >= SHORT_K_OUTPUTS:
        return (f"K={k} is at most {SHORT_K} over {batch * m * n} outputs: the tiles' fill and "
                "epilogue, where cuBLAS is faster")
    if copy_s > kernel_s:
        return (f"copying operands into the kernel's layout ({copy_s * 1e6:.1f} us) costs more "
                f"than the product ({kernel_s * 1e6:.1f} us)")
    return None


def legal_configs(m: int, n: int, k: int, out_dtype, out_strides: tuple[int, ...] | None = None,
                  splits: tuple[int, ...] = _SPLIT_CHOICES, batch: int = 1):
    """Yields every compiled tile that can compute `batch` M x N x K products into out_dtype
    (check_config), with each split-K factor of `splits` that a depth of k uses in full, and
    with stream-K where the tile takes it."""
    for tile in COMPILED_CONFIGS:
        for split_k in splits:
            cfg = dataclasses.replace(tile, split_k=split_k)
            if split_k > 1 and cfg.splits_for(k) != split_k:
                continue
            try:
                check_config(cfg, m, n, k, out_dtype, out_strides, batch)
            except ValueError:
                continue
            yield cfg
            if split_k == 1 and cfg.takes_stream_k:
                yield dataclasses.replace(cfg, stream_k=True)


def scored_configs(m: int, n: int, k: int, out_dtype, out_strides: tuple[int, ...] | None = None,
                   batch: int = 1):
    """The legal configurations worth considering for a product (default_config scores them,
    jax_tma.autotune times them): split-K runs without clusters (measured, the cluster's
    lockstep only slows its short K ranges down) and stream-K only where M fills the tile's
    rows (on 64 rows 128-row stream-K measured far slower than 64-row tiles:
    docs/cost-model.md)."""
    for cfg in legal_configs(m, n, k, out_dtype, out_strides, batch=batch):
        if not (cfg.split_k > 1 and cfg.cluster_m > 1 or cfg.stream_k and m < cfg.block_m):
            yield cfg


def default_config(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS,
                   out_dtype=jnp.bfloat16, batch: int = 1,
                   out_strides: tuple[int, ...] | None = None,
                   misaligned_rows: str = "",
                   dram_bytes_per_s: float = DEFAULT_DRAM_BYTES_PER_S,
                   l2_bytes: int = DEFAULT_L2_BYTES) -> GemmConfig | None:
    """Picks a configuration for `batch` products of M x N x K, or None when none can compute
    them (more work units or output bytes than the kernel takes: the product runs on XLA).

    Every configuration of ``scored_configs`` is scored by ``estimate_seconds`` (waves,
    last-wave utilization, tile efficiency and a fixed cost per tile, or memory traffic for
    skinny problems); among equal scores the deeper pipeline wins, then the cluster of 2 (B
    multicast), which halves the L2 traffic of B whenever both CTAs of a cluster have a tile,
    then no split and no stream-K.
    `misaligned_rows` names the operands, "a" and/or "b", whose rows are not 32-byte multiples
    apart (GemmPlan.misaligned_rows).
    `num_sms`, `dram_bytes_per_s` (peak DRAM bandwidth) and `l2_bytes` describe the device;
    jax_tma.matmul reads them from the device it runs on.
    """
    if not isinstance(misaligned_rows, str) or set(misaligned_rows) - {"a", "b"}:
        raise ValueError(f'misaligned_rows must be a string of "a" and/or "b" (the operands '
                         f"whose rows are not 32-byte multiples apart), got {misaligned_rows!r}")
    if not (isinstance(dram_bytes_per_s, (int, float)) and 0 < dram_bytes_per_s < math.inf):
        raise ValueError(f"dram_bytes_per_s must be a positive number of bytes per second (the "
                         f"device's peak DRAM bandwidth), got {dram_bytes_per_s!r}")
    if isinstance(l2_bytes, bool) or not isinstance(l2_bytes, int) or l2_bytes <= 0:
        raise ValueError(f"l2_bytes must be a positive int (the device's L2 cache in bytes), "
                         f"got {l2_bytes!r}")
    ranked = ranked_configs(m, n, k, num_sms, out_dtype, batch, out_strides, misaligned_rows,
                            dram_bytes_per_s, l2_bytes)
    return ranked[0] if ranked else None


def ranked_configs(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS,
                   out_dtype=jnp.bfloat16, batch: int = 1,
                   out_strides: tuple[int, ...] | None = None,
                   misaligned_rows: str = "",
                   dram_bytes_per_s: float = DEFAULT_DRAM_BYTES_PER_S,
                   l2_bytes: int = DEFAULT_L2_BYTES) -> list[GemmConfig]:
    """Every configuration of ``scored_configs``, best first as default_config ranks them
    (its arguments, unchecked): by ``estimate_seconds``, then the deeper pipeline, the cluster
    of 2 (where it multicasts), no split and no stream-K."""
    out_bytes = jnp.dtype(out_dtype).itemsize
    return ranked(scored_configs(m, n, k, out_dtype, out_strides, batch=batch),
                  lambda cfg: estimate_seconds(cfg, m, n, k, num_sms, out_bytes, batch,
                                               misaligned_rows, dram_bytes_per_s, l2_bytes),
                  lambda cfg: (-cfg.stages, -int(cfg.multicasts(m)), cfg.split_k,
                               int(cfg.stream_k)))

