// Tile schedulers of ragged (grouped) products, whose work depends on group sizes that live on
// the device: a prepare kernel (kernels/sm90_ragged_prepare.cuh) turns them into a table of
// row segments in global memory, and these schedulers read it. No group size reaches the host.
//
// A segment is a run of rows [row_begin, row_begin + rows) of the stacked row operand (batch
// entries one after another) that shares one weight matrix: group g of batch entry b, or the
// rows after a batch entry's last group, which multiply nothing (weight -1: zero rows).
//
// RaggedRowScheduler (ragged rows: D[rows of s] = A[rows of s] @ B[weight of s]): the
// segments' row blocks are numbered one after another across segments (RaggedSegment::
// first_block, a prefix sum the prepare kernel writes), and a cluster of 2 takes two
// consecutive blocks: a cluster row. A segment owns the cluster rows whose first block is
// its own, and its work units are those rows' (row, N block) pairs in the grouped order of
// TileScheduler, one segment after another; a unit's segment is found by binary search, and
// so is the segment of a cluster row's second block where it lies past the owner's. Tiles
// never straddle segments, so no tile mixes two groups' weights. Where both blocks of a
// cluster row lie in one segment the pair multicasts B; where they lie in two (one group's
// last block, the next's first) each CTA loads its own A rows and B weights (LoadMode::kSolo)
// over the same K slices, so the rings stay in step.
// NOTE: paired within each segment instead, a group with an odd number of blocks left its
// last cluster row's second CTA idle for the whole unit: with Zipf-sized groups a quarter of
// all CTA tiles of 8192 x 7168 x 2048, G = 32, on 128 x 256 pairs. Blocks of a zero segment
// (no K slices) must pair with each other only: such a segment starts at an even block and
// counts an even number of them (the last one past its rows, an idle CTA); so may the
// numbering's end. An idle CTA passes through as many K slices as its peer.
// NOTE: one grouped order over all the cluster rows, whose groups of kGroupM rows cross
// segments, ran the uniform products slower than the order per segment
// (docs/notebook/2026-11-29-tile-registry-figures.md).
//
// RaggedKScheduler (ragged contraction: D[s] = A[rows of s]^T @ B[rows of s]): one dense
// batch entry per segment, its K range the segment's rows in kBlockK slices (none for an
// empty segment: the consumers store zeros).
#pragma once

#include <algorithm>
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
  int32_t first_block;  // RaggedRowScheduler: the segment's first row block, numbered across
                        // segments; past the last segment: how many blocks there are in all
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
  static_assert(kClusterM == 1 || kClusterM == 2);

  struct Params {
    const RaggedSegment* segments;  // num_segments + 1 entries (written by the prepare kernel)
    int num_segments;
    int n_blocks;
    int k_blocks;
    FastDivmod units_per_row;    // n_blocks
    FastDivmod tiles_per_group;  // kGroupM * n_blocks
  };

  __host__ static Params make_params(const RaggedSegment* segments, int num_segments, int n,
                                     int k) {
    const int n_blocks = static_cast<int>((int64_t{n} + kBlockN - 1) / kBlockN);
    return Params{segments,
                  num_segments,
                  n_blocks,
                  static_cast<int>((int64_t{k} + kBlockK - 1) / kBlockK),
                  FastDivmod(std::max(n_blocks, 1)),
                  FastDivmod(kGroupM * std::max(n_blocks, 1))};
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
        num_units(load_segment(params.segments, params.num_segments).first_block / kClusterM *
                  params.n_blocks) {}

  // The first cluster row a segment starting at `first_block` owns.
  __device__ static int first_row(int first_block) {
    return (first_block + kClusterM - 1) / kClusterM;
  }

  // The last segment with key(segment) <= `value`, which skips the empty segments (and those
  // owning no cluster row) that share a key with the next.
  template <class Key>
  __device__ int last_segment_at(int value, Key&& key) const {
    int lo = 0, hi = p.num_segments - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (key(__ldg(&p.segments[mid].first_block)) <= value) {
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
    int in_row;
    const int owner_index = last_segment_at(p.units_per_row.divmod(linear, &in_row),
                                            [](int b) { return first_row(b); });
    const RaggedSegment owner = load_segment(p.segments, owner_index);
    const int owner_blocks = (owner.rows + kBlockM - 1) / kBlockM;
    const int row0 = first_row(owner.first_block);
    const int rows = first_row(owner.first_block + owner_blocks) - row0;
    int row;
    raster_tile(linear - row0 * p.n_blocks, rows, ConstDivmod<kGroupM>{}, p.tiles_per_group,
                Divmod{rows - (rows - 1) / kGroupM * kGroupM}, &row, &w.n_block);
    row += row0;
    // This CTA's block: the owner's, or the next segment's first, or past every segment's rows.
    const int block = row * kClusterM + rank;
    w.segment = block < owner.first_block + owner_blocks
                    ? owner_index
                    : last_segment_at(block, [](int b) { return b; });
    const RaggedSegment s = w.segment == owner_index ? owner : load_segment(p.segments, w.segment);
    w.row_begin = s.row_begin;
    w.rows = s.rows;
    const int m_blocks = (s.rows + kBlockM - 1) / kBlockM;
    w.m_block = block - s.first_block;
    w.self_valid = w.m_block < m_blocks;
    // Both blocks of the cluster row in this segment: B is multicast.
    const int first = row * kClusterM;
    w.cluster_full = first >= s.first_block && first + kClusterM <= s.first_block + m_blocks;
    w.batch = s.weight;
    // A zero segment's rows load nothing; so does an idle block past its rows (its peer's
    // too, by the numbering). Any other idle block's peer is a group's.
    w.k_end = s.weight < 0 && s.rows > 0 ? 0 : p.k_blocks;
    return w;
  }

  __device__ RaggedWorkTile first() const { return unit(cluster); }
  __device__ bool valid(const RaggedWorkTile& w) const { return w.linear < num_units; }
  __device__ bool last(const RaggedWorkTile& w) const {
    return w.linear + num_clusters >= num_units;
  }
  __device__ RaggedWorkTile next(const RaggedWorkTile& w) const {
    return unit(w.linear + num_clusters);
  }
};

template <int kBlockM, int kBlockN, int kClusterM, int kBlockK, int kGroupM = 8>
struct RaggedKScheduler {
  using Dense = TileScheduler<kBlockM, kBlockN, kClusterM>;
  struct Params {
    typename Dense::Params tiles;   // batch = segments, no split-K or stream-K
    const RaggedSegment* segments;  // written by the prepare kernel
  };

  __host__ static Params make_params(const RaggedSegment* segments, int num_segments, int m,
                                     int n) {
    return Params{Dense::make_params(m, n, num_segments, 1, 1, 1, 0, kGroupM), segments};
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
  __device__ bool last(const RaggedWorkTile& w) const { return dense.last(w); }
  __device__ RaggedWorkTile next(const RaggedWorkTile& w) const {
    return with_segment(dense.next(w));
  }
};

}  // namespace jax_tma
