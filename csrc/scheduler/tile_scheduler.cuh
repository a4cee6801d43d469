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
  int m_blocks;
  int n_blocks;
  int cluster_rows;
  int tiles_per_batch;
  int units_per_split;
  int num_units;
  int cluster;       // this CTA's cluster index
  int num_clusters;  // clusters in the grid
  int rank;          // CTA rank within the cluster (clusters are laid out along x)

  // NOTE: the host checks that splits x batch x tiles fits in int32 (ffi/gemm.cc).
  __device__ TileScheduler(int m, int n, int batch, int splits)
      : m_blocks((m + kBlockM - 1) / kBlockM),
        n_blocks((n + kBlockN - 1) / kBlockN),
        cluster_rows((m_blocks + kClusterM - 1) / kClusterM),
        tiles_per_batch(cluster_rows * n_blocks),
        units_per_split(tiles_per_batch * batch),
        num_units(units_per_split * splits),
        cluster(static_cast<int>(blockIdx.x) / kClusterM),
        num_clusters(static_cast<int>(gridDim.x) / kClusterM),
        rank(static_cast<int>(blockIdx.x) % kClusterM) {}

  __device__ WorkTile unit(int linear) const {
    WorkTile w{linear, 0, 0, 0, 0, false, false};
    if (linear >= num_units) return w;
    w.split = linear / units_per_split;
    const int in_split = linear - w.split * units_per_split;
    w.batch = in_split / tiles_per_batch;
    const int tile = in_split - w.batch * tiles_per_batch;
    const int tiles_per_group = kGroupM * n_blocks;
    const int group = tile / tiles_per_group;
    const int first_row = group * kGroupM;
    const int group_rows = min(cluster_rows - first_row, kGroupM);
    const int in_group = tile - group * tiles_per_group;
    const int row = first_row + in_group % group_rows;
    w.n_block = in_group / group_rows;
    w.m_block = row * kClusterM + rank;
    w.self_valid = w.m_block < m_blocks;
    w.cluster_full = (row + 1) * kClusterM <= m_blocks;
    return w;
  }

  __device__ WorkTile first() const { return unit(cluster); }
  __device__ bool valid(const WorkTile& w) const { return w.linear < num_units; }
  __device__ WorkTile next(const WorkTile& w) const { return unit(w.linear + num_clusters); }
};

}  // namespace jax_tma
