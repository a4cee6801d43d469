// Persistent tile scheduler with grouped rasterisation.
//
// Tiles are numbered so that kGroupM consecutive M-tiles sweep the N dimension together: the
// CTAs resident at one time then share a few rows of A and columns of B in L2. Each CTA
// starts at its block index and strides by the grid size, so a grid of min(tiles, SMs) CTAs
// is persistent and a grid of `tiles` CTAs runs one tile each.
#pragma once

#include <cstdint>

namespace jax_tma {

struct TileCoord {
  int linear;
  int m_block;
  int n_block;
};

template <int kBlockM, int kBlockN, int kGroupM = 8>
struct GroupedTileScheduler {
  int m_blocks;
  int n_blocks;
  int num_tiles;

  __device__ GroupedTileScheduler(int m, int n)
      : m_blocks((m + kBlockM - 1) / kBlockM),
        n_blocks((n + kBlockN - 1) / kBlockN),
        num_tiles(m_blocks * n_blocks) {}

  __device__ TileCoord tile(int linear) const {
    if (linear >= num_tiles) return {linear, 0, 0};
    const int tiles_per_group = kGroupM * n_blocks;
    const int group = linear / tiles_per_group;
    const int first_m = group * kGroupM;
    const int group_m = min(m_blocks - first_m, kGroupM);
    const int in_group = linear - group * tiles_per_group;
    return {linear, first_m + in_group % group_m, in_group / group_m};
  }

  __device__ TileCoord first() const { return tile(blockIdx.x); }
  __device__ bool valid(const TileCoord& t) const { return t.linear < num_tiles; }
  __device__ TileCoord next(const TileCoord& t) const {
    return tile(t.linear + static_cast<int>(gridDim.x));
  }
};

}  // namespace jax_tma
