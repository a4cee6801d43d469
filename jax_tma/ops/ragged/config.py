"""Configurations of the sm90 ragged (grouped GEMM) kernel: the compiled tiles (GemmConfigs:
the dense GEMM's mainloop), the check of a caller's choice, and the heuristic that picks one.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_tma._core import device, tiles
from jax_tma._core.config import fastest, require_among
from jax_tma.ops.gemm.config import GemmConfig, estimate_seconds

# The primitive's two forms: rows of groups times per-group weights, and the weight gradient
# (contraction over each group's rows).
ROWS, CONTRACTION = "rows", "contraction"
# (block_m, block_n, stages, cluster_m) of the compiled ragged tiles (the tile registry,
# jax_tma/_core/tiles.py).
_RAGGED_TILES = tiles.keys(tiles.RAGGED_TILES)
RAGGED_CONFIGS: tuple[GemmConfig, ...] = tuple(GemmConfig(*t) for t in _RAGGED_TILES)


def check_config(config: GemmConfig) -> GemmConfig:
    """`config` if the ragged kernel is compiled with it; else a ValueError naming the choices."""
    return require_among(config, RAGGED_CONFIGS, "ragged_dot", "ragged products", split_k=1,
                         stream_k=False)


def default_config(mode: str, rows: int, n: int, k: int, groups: int,
                   num_sms: int | None = None, out_dtype=jnp.bfloat16) -> GemmConfig:
    """The compiled ragged tile with the least estimated time, groups assumed of equal size.

    rows mode: G products of (rows / G) x n x k, each reading its own weights; contraction mode:
    G products of k x n contracted over rows / G. Both are scored by the dense GEMM's cost model
    (ops/gemm/config.estimate_seconds) as a batch of G products; ties go to the deeper pipeline,
    then the cluster of 2."""
    num_sms = device.num_sms() if num_sms is None else num_sms
    per_group = max(1, -(-rows // groups))
    m, kk = (per_group, k) if mode == ROWS else (k, per_group)
    return fastest(RAGGED_CONFIGS,
                   lambda cfg: estimate_seconds(cfg, m, n, kk, num_sms,
                                                jnp.dtype(out_dtype).itemsize, batch=groups,
                                                dram_bytes_per_s=device.dram_bytes_per_s(),
                                                l2_bytes=device.l2_bytes()),
                   lambda cfg: (-cfg.stages, -cfg.cluster_m))


# The gated rows form (gated_ragged_dot): its own compiled tiles (block_n counts gate and up
# columns: a tile stores block_n / 2 outputs).
GATED_RAGGED_CONFIGS: tuple[GemmConfig, ...] = tuple(
    GemmConfig(*t) for t in tiles.keys(tiles.RAGGED_GATED_TILES))


def check_gated_config(config: GemmConfig) -> GemmConfig:
    """`config` if the gated ragged kernel is compiled with it; else a ValueError naming the
    choices."""
    return require_among(config, GATED_RAGGED_CONFIGS, "gated_ragged_dot",
                         "gated ragged products", split_k=1, stream_k=False)


def default_gated_config(rows: int, n: int, k: int, groups: int,
                         num_sms: int | None = None) -> GemmConfig:
    """The compiled gated tile with the least estimated time: the rows form's model over the
    accumulator's 2 n columns (gate and up), groups assumed of equal size."""
    num_sms = device.num_sms() if num_sms is None else num_sms
    per_group = max(1, -(-rows // groups))
    return fastest(GATED_RAGGED_CONFIGS,
                   lambda cfg: estimate_seconds(cfg, per_group, 2 * n, k, num_sms, 2,
                                                batch=groups,
                                                dram_bytes_per_s=device.dram_bytes_per_s(),
                                                l2_bytes=device.l2_bytes()),
                   lambda cfg: (-cfg.stages, -cfg.cluster_m))


# The gated gradient rows form (gated_ragged_mlp's backward): its compiled tile(s), picked by
# the same model over the cotangents' F columns.
GATED_RAGGED_GRAD_CONFIGS: tuple[GemmConfig, ...] = tuple(
    GemmConfig(*t) for t in tiles.keys(tiles.RAGGED_GATED_GRAD_TILES))


def default_gated_grad_config(rows: int, n: int, k: int, groups: int,
                              num_sms: int | None = None) -> GemmConfig:
    """The compiled gated gradient tile with the least estimated time (dh = dy @ w_down^T: the
    rows form's model over n = F columns and k = D), groups assumed of equal size."""
    num_sms = device.num_sms() if num_sms is None else num_sms
    per_group = max(1, -(-rows // groups))
    return fastest(GATED_RAGGED_GRAD_CONFIGS,
                   lambda cfg: estimate_seconds(cfg, per_group, n, k, num_sms, 2, batch=groups,
                                                dram_bytes_per_s=device.dram_bytes_per_s(),
                                                l2_bytes=device.l2_bytes()),
                   lambda cfg: (-cfg.stages, -cfg.cluster_m))


def widen_sizes(gs):
    """Integer group sizes narrower than 32 bits as int32 (others as they are): their running
    sums (lax's and the kernels') and clamps to M would wrap in int8 or int16."""
    gs = jnp.asarray(gs)
    if jnp.issubdtype(gs.dtype, jnp.integer) and jnp.iinfo(gs.dtype).bits < 32:
        return gs.astype(jnp.int32)
    return gs


def clamp_sizes(gs, rows: int) -> jnp.ndarray:
    """Group sizes clamped to [0, rows] as int32, whatever their integer type (a narrow one is
    widened first, a wider one clamped before it narrows)."""
    return jnp.clip(widen_sizes(gs), 0, rows).astype(jnp.int32)
