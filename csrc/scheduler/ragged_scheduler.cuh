// Tile schedulers of ragged (grouped) products, whose work depends on group sizes that live on
// the device: a prepare kernel (kernels/sm90_ragged_prepare.cuh) turns them into a table of
// row segments in global memory, and these schedulers read it. No group size reaches the host.
//
// A segment is a run of rows [row_begin, row_begin + rows) of the stacked row operand (batch
// entries one after another) that shares one weight matrix: group g of batch entry b, or the
// rows after a batch entry's last group, which multiply nothing (weight -1: zero rows).
//
// RaggedRowScheduler (ragged rows: D[rows of s] = A[rows of s] @ B[weight of s]): work units
// are (segment, cluster row, N block) triples, segment-major, each segment's tiles in the
// grouped order of TileScheduler; unit numbers start where the previous segment's end
// (RaggedSegment::first_unit, a prefix sum the prepare kernel writes). A unit's segment is
// found by binary search. Tiles never straddle segments, so no tile mixes two groups' weights.
//
// RaggedKScheduler (ragged contraction: D[s] = A[rows of s]^T @ B[rows of s]): one dense
// batch entry per segment, its K range the segment's rows in kBlockK slices (none for an
// empty segment: the consumers store zeros).
#pragma once

#include <cstdint>

#include "scheduler/fast_divmod.cuh"
#include "scheduler/tile_scheduler.cuh"

namespace jax_tma {

// One row segment of the table, 16 bytes: one vector load. The table has one entry past the
// last segment whose first_unit is the number of units (RaggedRowScheduler).
struct alignas(16) RaggedSegment {
  int32_t row_begin;   // first row in the stacked row numbering
  int32_t rows;        // 0 for an empty group
  int32_t weight;      // B's batch coordinate for these rows; -1: the rows are zero
  int32_t first_unit;  // RaggedRowScheduler: the segment's first work unit
};

__device__ __forceinline__ RaggedSegment load_segment(const RaggedSegment* table, int s) {
  const int4 v = __ldg(reinterpret_cast<const int4*>(table) + s);
  return RaggedSegment{v.x, v.y, v.z, v.w};
}

// A WorkTile of a ragged product: also its segment, whose rows it lies in.
struct RaggedWorkTile : WorkTile {
  int segment;
  int row_begin;  // the segment's first row and row count
  int rows;
};

template <int kBlockM, int kBlockN, int kClusterM, int kBlockK, int kGroupM = 8>
struct RaggedRowScheduler {
  struct Params {
    const RaggedSegment* segments;  // num_segments + 1 entries (written by the prepare kernel)
    int num_segments;
    int n_blocks;
    int k_blocks;
    FastDivmod tiles_per_group;  // kGroupM * n_blocks
  };

  __host__ static Params make_params(const RaggedSegment* segments, int num_segments, int n,
                                     int k) {
    const int n_blocks = static_cast<int>((int64_t{n} + kBlockN - 1) / kBlockN);
    return Params{segments, num_segments, n_blocks,
                  static_cast<int>((int64_t{k} + kBlockK - 1) / kBlockK),
                  FastDivmod(kGroupM * n_blocks)};
  }

  Params p;
  int cluster;
  int num_clusters;
  int rank;
  int num_units;

  __device__ explicit RaggedRowScheduler(const Params& params)
      : p(params),
        cluster(static_cast<int>(blockIdx.x) / kClusterM),
        num_clusters(static_cast<int>(gridDim.x) / kClusterM),
        rank(static_cast<int>(blockIdx.x) % kClusterM),
        num_units(load_segment(params.segments, params.num_segments).first_unit) {}

  // The segment holding unit `linear` (< num_units): the last one that starts at or before it,
  // which skips the empty segments that start at the same unit.
  __device__ int find_segment(int linear) const {
    int lo = 0, hi = p.num_segments - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (__ldg(&p.segments[mid].first_unit) <= linear) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }

  __device__ RaggedWorkTile unit(int linear) const {
    RaggedWorkTile w{};
    w.linear = linear;
    w.piece = -1;
    if (linear >= num_units) return w;
    w.segment = find_segment(linear);
    const RaggedSegment s = load_segment(p.segments, w.segment);
    w.row_begin = s.row_begin;
    w.rows = s.rows;
    const int m_blocks = (s.rows + kBlockM - 1) / kBlockM;
    const int cluster_rows = (m_blocks + kClusterM - 1) / kClusterM;
    const int last_rows = cluster_rows - (cluster_rows - 1) / kGroupM * kGroupM;
    int row;
    raster_tile<kGroupM>(linear - s.first_unit, cluster_rows, p.tiles_per_group,
                         Divmod{last_rows}, &row, &w.n_block);
    w.m_block = row * kClusterM + rank;
    w.self_valid = w.m_block < m_blocks;
    w.cluster_full = (row + 1) * kClusterM <= m_blocks;
    w.batch = s.weight;
    w.k_end = s.weight < 0 ? 0 : p.k_blocks;  // zero rows: nothing to load
    return w;
  }

  __device__ RaggedWorkTile first() const { return unit(cluster); }
  __device__ bool valid(const RaggedWorkTile& w) const { return w.linear < num_units; }
  __device__ RaggedWorkTile next(const RaggedWorkTile& w) const {
    return unit(w.linear + num_clusters);
  }
};

template <int kBlockM, int kBlockN, int kClusterM, int kBlockK, int kGroupM = 8>
struct RaggedKScheduler {
  using Dense = TileScheduler<kBlockM, kBlockN, kClusterM, kGroupM>;
  struct Params {
    typename Dense::Params tiles;   // batch = segments, no split-K or stream-K
    const RaggedSegment* segments;  // written by the prepare kernel
  };

  __host__ static Params make_params(const RaggedSegment* segments, int num_segments, int m,
                                     int n) {
    return Params{Dense::make_params(m, n, num_segments, 1, 1, 1, 0), segments};
  }

  Dense dense;
  const RaggedSegment* segments;
  int rank;

  __device__ explicit RaggedKScheduler(const Params& params)
      : dense(params.tiles), segments(params.segments), rank(dense.rank) {}

  __device__ RaggedWorkTile with_segment(const WorkTile& t) const {
    RaggedWorkTile w{};
    static_cast<WorkTile&>(w) = t;
    if (!dense.valid(t)) return w;
    const RaggedSegment s = load_segment(segments, t.batch);
    w.segment = t.batch;
    w.row_begin = s.row_begin;
    w.rows = s.rows;
    w.k_begin = 0;
    w.k_end = (s.rows + kBlockK - 1) / kBlockK;
    return w;
  }

  __device__ RaggedWorkTile first() const { return with_segment(dense.first()); }
  __device__ bool valid(const RaggedWorkTile& w) const { return dense.valid(w); }
  __device__ RaggedWorkTile next(const RaggedWorkTile& w) const {
    return with_segment(dense.next(w));
  }
};

}  // namespace jax_tma
