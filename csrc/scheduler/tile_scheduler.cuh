// Persistent tile scheduler: grouped rasterisation, clusters along M, batches, split-K and
// stream-K.
//
// Work units are (split, batch entry, tile) triples, split outermost, so CTAs resident at one
// time share a K range and with it the operand slices in L2; then the batch entry, so they
// share one entry's operands. Within a batch entry, tiles are numbered so that a group of
// consecutive cluster rows sweeps the N dimension together (group_rows_for). A cluster of
// kClusterM CTAs takes one cluster row of a unit: CTA rank r computes M block
// (cluster_row * kClusterM + r) of the same batch entry, all of them the same N block and K
// range. Clusters start at their cluster index and stride by the number of clusters in the grid
// (persistent when the grid holds fewer clusters than units).
//
// Stream-K (one CTA per cluster, no split-K): when the units do not fill the last wave of the
// grid, the whole waves go round as above ("data-parallel") and the K slices of the units left
// over, taken in (unit, slice) order, are dealt out as equal contiguous ranges to the CTAs, so
// every CTA finishes at about the same time. A range cuts units into pieces. The piece that
// starts a unit's K range (its "head") finishes the unit: it adds the fp32 partial sums that
// the CTAs after it left for the rest of the unit (epilogue/partial_tiles.cuh), in CTA order,
// and runs the epilogue. Every other piece is the first piece of its CTA's range, so no CTA
// waits before it has published its own partial sums: heads wait only on later CTAs' first
// pieces, and the last CTA's range ends a unit. (That needs every CTA of the grid resident at
// once, which a persistent grid is.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "scheduler/fast_divmod.cuh"

namespace jax_tma {

struct WorkTile {
  int linear;         // unit index; >= num_units when the CTA is done
  int m_block;        // this CTA's M block (may lie past the matrix: see `self_valid`)
  int n_block;
  int batch;
  int split;
  int k_begin;        // the K slices [k_begin, k_end) of the unit that this CTA computes
  int k_end;
  int piece;          // -1: the unit's whole K range; stream-K: the piece's first iteration
  bool self_valid;    // this CTA's M block exists
  bool cluster_full;  // every CTA of the cluster has its M block: B may be multicast
};

// Grouped rasterisation of one batch entry's tiles (cluster rows x N blocks): tile `tile` is
// cluster row *row, N block *n_block, `group` (its divisor: the group's cluster rows)
// consecutive cluster rows sweeping the N blocks together. `tiles_per_group` divides by the
// group's rows x N blocks, `last_rows` by the cluster rows of the last group (the group's, or
// fewer): a FastDivmod, or a Divmod where the rows vary by entry.
template <class GroupDiv, class LastRowsDiv>
__device__ __forceinline__ void raster_tile(int tile, int cluster_rows, const GroupDiv& group,
                                            const FastDivmod& tiles_per_group,
                                            const LastRowsDiv& last_rows, int* row,
                                            int* n_block) {
  int in_group;
  const int group_rows = static_cast<int>(group.divisor);
  const int first_row = tiles_per_group.divmod(tile, &in_group) * group_rows;
  if (first_row + group_rows <= cluster_rows) {  // a whole group
    *n_block = group.divmod(in_group, row);
  } else {
    *n_block = last_rows.divmod(in_group, row);
  }
  *row += first_row;
}

template <int kBlockM, int kBlockN, int kClusterM>
struct TileScheduler {
  // Shortest stream-K range worth a partial tile's round trip through memory, in K slices.
  static constexpr int kMinStreamKSlices = 4;

  // The grid's shared numbers, computed once on the host (its divisors as FastDivmod).
  struct Params {
    int m_blocks;
    int cluster_rows;
    int num_units;
    int k_blocks;            // K slices of the product
    int k_blocks_per_split;  // K slices per split; the last split may have fewer
    FastDivmod units_per_split;
    FastDivmod tiles_per_batch;
    FastDivmod group_rows;       // cluster rows of a group (group_rows_for)
    FastDivmod tiles_per_group;  // group_rows * n_blocks
    FastDivmod last_group_rows;  // cluster rows of the last group (group_rows, or fewer)
    // Stream-K: units [0, dp_units) are whole; the (num_units - dp_units) * k_blocks iterations
    // of the rest go to CTAs [0, sk_ctas), sk_base each and one more for the first sk_extra.
    // Without stream-K, dp_units = num_units and sk_ctas = 0.
    int dp_units;
    int sk_ctas;
    int sk_base;
    int sk_extra;
    FastDivmod k_blocks_div;
  };

  // The cluster rows of a group for a grid of `ctas` CTAs: about sqrt(ctas x kBlockN / kBlockM)
  // M blocks, so that a wave of tiles spans A rows and B columns of about equal bytes, the
  // least that a wave of that many tiles reads (a wave's A and B, read again by the next one,
  // stay in L2 the more for it).
  __host__ static int group_rows_for(int ctas) {
    const double blocks = std::sqrt(static_cast<double>(std::max(ctas, 1)) * kBlockN / kBlockM);
    return std::max(1, static_cast<int>(std::lround(blocks / kClusterM)));
  }

  // `stream_k_ctas`: CTAs that may share the last wave's K slices (the grid's size; 0: no
  // stream-K). Stream-K applies when it leaves every CTA at least kMinStreamKSlices and gives
  // more CTAs work than the whole units would (otherwise sk_ctas = 0). `group_rows`: cluster
  // rows per group (group_rows_for).
  // NOTE: the host checks that splits x batch x tiles is at most INT32_MAX / 2 (ffi/gemm.cc).
  // NOTE: block counts are computed in 64 bits: m or n within one tile of 2^31 would wrap.
  __host__ static Params make_params(int m, int n, int batch, int splits, int k_blocks,
                                     int k_blocks_per_split, int stream_k_ctas, int group_rows) {
    const int m_blocks = static_cast<int>((int64_t{m} + kBlockM - 1) / kBlockM);
    const int n_blocks = static_cast<int>((int64_t{n} + kBlockN - 1) / kBlockN);
    const int cluster_rows = (m_blocks + kClusterM - 1) / kClusterM;
    const int tiles_per_batch = cluster_rows * n_blocks;
    const int last_rows = cluster_rows - (cluster_rows - 1) / group_rows * group_rows;
    const int num_units = tiles_per_batch * batch * splits;
    Params p{m_blocks,
             cluster_rows,
             num_units,
             k_blocks,
             k_blocks_per_split,
             FastDivmod(tiles_per_batch * batch),
             FastDivmod(tiles_per_batch),
             FastDivmod(group_rows),
             FastDivmod(group_rows * n_blocks),
             FastDivmod(last_rows),
             num_units,
             0,
             0,
             0,
             FastDivmod(k_blocks)};
    if (kClusterM == 1 && splits == 1 && stream_k_ctas > 0) {
      const int left = num_units % stream_k_ctas;
      const int64_t iterations = int64_t{left} * k_blocks;
      const int64_t ctas = std::min<int64_t>(stream_k_ctas, iterations / kMinStreamKSlices);
      if (left > 0 && ctas > left && iterations <= INT32_MAX / 2) {
        p.dp_units = num_units - left;
        p.sk_ctas = static_cast<int>(ctas);
        p.sk_base = static_cast<int>(iterations / ctas);
        p.sk_extra = static_cast<int>(iterations % ctas);
      }
    }
    return p;
  }

  Params p;
  int cluster;       // this CTA's cluster index
  int num_clusters;  // clusters in the grid
  int rank;          // CTA rank within the cluster (clusters are laid out along x)

  __device__ explicit TileScheduler(const Params& params)
      : p(params),
        cluster(static_cast<int>(blockIdx.x) / kClusterM),
        num_clusters(static_cast<int>(gridDim.x) / kClusterM),
        rank(static_cast<int>(blockIdx.x) % kClusterM) {}

  // Unit `linear`, whole (its split's K range).
  __device__ WorkTile unit(int linear) const {
    WorkTile w{linear, 0, 0, 0, 0, 0, 0, -1, false, false};
    if (linear >= p.num_units) return w;
    int in_split, tile, row;
    w.split = p.units_per_split.divmod(linear, &in_split);
    w.batch = p.tiles_per_batch.divmod(in_split, &tile);
    raster_tile(tile, p.cluster_rows, p.group_rows, p.tiles_per_group, p.last_group_rows, &row,
                &w.n_block);
    w.m_block = row * kClusterM + rank;
    w.self_valid = w.m_block < p.m_blocks;
    w.cluster_full = (row + 1) * kClusterM <= p.m_blocks;
    w.k_begin = w.split * p.k_blocks_per_split;
    w.k_end = min(p.k_blocks, w.k_begin + p.k_blocks_per_split);
    return w;
  }

  // Stream-K: the first iteration of CTA `cta`'s range (the range ends where cta + 1's begins).
  __device__ int range_begin(int cta) const { return cta * p.sk_base + min(cta, p.sk_extra); }
  // Stream-K: the length of CTA `cta`'s range.
  __device__ int range_length(int cta) const { return p.sk_base + (cta < p.sk_extra ? 1 : 0); }

  // Stream-K: the piece of this CTA's range that starts at iteration `it`, or none past its end.
  __device__ WorkTile piece(int it) const {
    const int end = range_begin(cluster + 1);
    if (cluster >= p.sk_ctas || it >= end) return unit(p.num_units);
    int k_begin;
    const int u = p.k_blocks_div.divmod(it, &k_begin);
    WorkTile w = unit(p.dp_units + u);
    w.k_begin = k_begin;
    w.k_end = min(p.k_blocks, k_begin + (end - it));
    w.piece = it;
    return w;
  }

  __device__ WorkTile first() const {
    return cluster < p.dp_units ? unit(cluster) : piece(range_begin(cluster));
  }
  __device__ bool valid(const WorkTile& w) const { return w.linear < p.num_units; }
  // Whether `w` is this CTA's last unit (next(w) is not valid), without decomposing the next.
  __device__ bool last(const WorkTile& w) const {
    if (w.piece >= 0) return w.piece + (w.k_end - w.k_begin) >= range_begin(cluster + 1);
    return w.linear + num_clusters >= p.dp_units &&
           (cluster >= p.sk_ctas || range_length(cluster) <= 0);
  }
  __device__ WorkTile next(const WorkTile& w) const {
    if (w.piece >= 0) return piece(w.piece + (w.k_end - w.k_begin));
    const int linear = w.linear + num_clusters;
    return linear < p.dp_units ? unit(linear) : piece(range_begin(cluster));
  }
};

}  // namespace jax_tma
