// Persistent tile scheduler: grouped rasterisation, clusters along M, batches, split-K.
//
// Work units are (split, batch entry, tile) triples, split outermost, so CTAs resident at one
// time share a K range and with it the operand slices in L2; then the batch entry, so they
// share one entry's operands. Within a batch entry, tiles are numbered so that kGroupM
// consecutive cluster rows sweep the N dimension together. A cluster of kClusterM CTAs takes
// one cluster row of a unit: CTA rank r computes M block (cluster_row * kClusterM + r) of the
// same batch entry, all of them the same N block and K range. Clusters start at their cluster
// index and stride by the number of clusters in the grid (persistent when the grid holds fewer
// clusters than units).
#pragma once

#include <cstdint>

#include "scheduler/fast_divmod.cuh"

namespace jax_tma {

struct WorkTile {
  int linear;         // unit index; >= num_units when the CTA is done
  int m_block;        // this CTA's M block (may lie past the matrix: see `self_valid`)
  int n_block;
  int batch;
  int split;
  bool self_valid;    // this CTA's M block exists
  bool cluster_full;  // every CTA of the cluster has its M block: B may be multicast
};

template <int kBlockM, int kBlockN, int kClusterM, int kGroupM = 8>
struct TileScheduler {
  // The grid's shared numbers, computed once on the host (its divisors as FastDivmod).
  struct Params {
    int m_blocks;
    int cluster_rows;
    int num_units;
    FastDivmod units_per_split;
    FastDivmod tiles_per_batch;
    FastDivmod tiles_per_group;  // kGroupM * n_blocks
    FastDivmod last_group_rows;  // cluster rows of the last group (kGroupM, or fewer)
  };

  // NOTE: the host checks that splits x batch x tiles fits in int32 (ffi/gemm.cc).
  __host__ static Params make_params(int m, int n, int batch, int splits) {
    const int m_blocks = (m + kBlockM - 1) / kBlockM;
    const int n_blocks = (n + kBlockN - 1) / kBlockN;
    const int cluster_rows = (m_blocks + kClusterM - 1) / kClusterM;
    const int tiles_per_batch = cluster_rows * n_blocks;
    const int last_rows = cluster_rows - (cluster_rows - 1) / kGroupM * kGroupM;
    return Params{m_blocks,
                  cluster_rows,
                  tiles_per_batch * batch * splits,
                  FastDivmod(tiles_per_batch * batch),
                  FastDivmod(tiles_per_batch),
                  FastDivmod(kGroupM * n_blocks),
                  FastDivmod(last_rows)};
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

  __device__ WorkTile unit(int linear) const {
    WorkTile w{linear, 0, 0, 0, 0, false, false};
    if (linear >= p.num_units) return w;
    int in_split, tile, in_group, row;
    w.split = p.units_per_split.divmod(linear, &in_split);
    w.batch = p.tiles_per_batch.divmod(in_split, &tile);
    const int first_row = p.tiles_per_group.divmod(tile, &in_group) * kGroupM;
    if (first_row + kGroupM <= p.cluster_rows) {  // a whole group: kGroupM is a constant
      row = first_row + in_group % kGroupM;
      w.n_block = in_group / kGroupM;
    } else {
      w.n_block = p.last_group_rows.divmod(in_group, &row);
      row += first_row;
    }
    w.m_block = row * kClusterM + rank;
    w.self_valid = w.m_block < p.m_blocks;
    w.cluster_full = (row + 1) * kClusterM <= p.m_blocks;
    return w;
  }

  __device__ WorkTile first() const { return unit(cluster); }
  __device__ bool valid(const WorkTile& w) const { return w.linear < p.num_units; }
  __device__ WorkTile next(const WorkTile& w) const { return unit(w.linear + num_clusters); }
};

}  // namespace jax_tma
