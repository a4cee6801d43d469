// Persistent TMA copy of a 2-D tensor of 32-bit words (benchmarks/bench_tma_copy.py): each
// CTA walks its tiles through a ring of shared-memory stages, TMA loads running ahead of TMA
// stores. Tiles are kTmaCopyBoxRows rows x kTmaCopyBoxCols words (1 KiB contiguous per row, so
// DRAM sees long bursts); edge tiles are zero-filled on load and clipped on store, so any shape
// with 16-byte aligned rows is copied exactly.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_tma::testing {

constexpr uint32_t kTmaCopyElementBytes = 4;
constexpr uint32_t kTmaCopyBoxRows = 16;
constexpr uint32_t kTmaCopyBoxCols = 256;  // the largest box extent
constexpr uint32_t kTmaCopyTileBytes = kTmaCopyBoxRows * kTmaCopyBoxCols * kTmaCopyElementBytes;

struct TmaCopyArgs {
  const CUtensorMap* map_in;   // uint32 [rows, row words], box kTmaCopyBoxRows x kTmaCopyBoxCols
  const CUtensorMap* map_out;  // same shape and box
  int tiles_per_row;
  int num_tiles;
  int stages;  // 4, 6 or 12
  int ctas;    // grid size: a few CTAs per SM
};

// Dynamic shared memory one CTA of the `stages`-stage kernel needs.
uint32_t tma_copy_smem_bytes(int stages);

cudaError_t launch_tma_copy(const TmaCopyArgs& args, cudaStream_t stream);

}  // namespace jax_tma::testing
