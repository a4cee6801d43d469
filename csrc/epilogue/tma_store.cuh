// Epilogue through shared memory and TMA stores: one consumer warpgroup writes its 64 x kBlockN
// accumulator block in chunks of 64 rows x 128 bytes (64 16-bit or 32 fp32 columns). Chunks are
// converted to the output type and written 128-byte swizzled (stmatrix for 16-bit outputs) into
// a staging area of kBuffers chunks, then handed to TMA stores that clip them to D's bounds.
// The staging area is filled in batches of kBuffers chunks: one wait, one fence and two named
// barriers per batch, so a block that fits the staging area takes one batch, whose wait is for
// the previous tile's stores (long done). The stores run asynchronously: the warpgroup goes on
// to the next tile's mainloop while they drain.
// D's tensor map is rank 4, {N, M, batch, split}, with a box of one chunk.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <utility>

#include "pipeline/named_barrier.cuh"
#include "pipeline/tma_store_pipeline.cuh"
#include "ptx/stmatrix.cuh"
#include "ptx/tma.cuh"

namespace jax_tma {

template <class Out>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Where one consumer warpgroup's block goes: D's map (a kernel parameter, or a map in global
// memory) and the coordinates of the block's first element; `rows` and `cols` are D's extent
// in the map's coordinates: a block that starts past `rows`, or a chunk past `cols`, is not
// stored (TMA would clip all of it).
struct StorePlan {
  const CUtensorMap* d;
  int row, col, batch, split;
  int rows, cols;
};

template <class Out, int kBlockN, int kBuffers>
struct TmaStoreEpilogue {
  static constexpr int kRows = 64;
  static constexpr int kChunkCols = 128 / static_cast<int>(sizeof(Out));
  static constexpr int kChunks = (kBlockN + kChunkCols - 1) / kChunkCols;
  static constexpr uint32_t kChunkBytes = kRows * 128;
  static_assert(kChunks % kBuffers == 0, "the staging area holds whole batches of chunks");
  static_assert(kBlockN >= kChunkCols && kBlockN % 8 == 0,
                "chunks start on the accumulators' 8-column blocks");

  // First column of chunk `c` in the block. A width that is not a multiple of the chunk's
  // (232) ends with a chunk shifted left to end at the block's edge: it repeats columns of the
  // chunk before it, so both stores write the same values there, and no store reaches the next
  // tile's columns (TMA clips only at D's edge).
  static constexpr int chunk_col(int c) {
    return c * kChunkCols < kBlockN - kChunkCols ? c * kChunkCols : kBlockN - kChunkCols;
  }
  // One store group per batch, and the next batch rewrites the whole staging area.
  using StorePipeline = PipelineTmaStore<1>;

  struct SharedStorage {
    alignas(1024) uint8_t buffer[kBuffers][kChunkBytes];
  };

  // Byte offset of 16-byte unit `unit` of row `row` in a 128-byte-swizzled chunk.
  __device__ static uint32_t swizzled(int row, int unit) {
    return static_cast<uint32_t>(row * 128 + ((unit ^ (row & 7)) << 4));
  }

  // Chunk `c` of the accumulators (layout: ptx/wgmma.cuh) into the staging buffer at `base`.
  template <int c>
  __device__ static void write_chunk(const float (&acc)[kBlockN / 2], uint32_t base) {
    const int lane = threadIdx.x % 32;
    const int warp = (threadIdx.x / 32) % 4;
    if constexpr (sizeof(Out) == 2) {
      // One stmatrix.x4 per 16 x 16 block: matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15)
      // come from registers 8q + {0,1}, {2,3}, {4,5}, {6,7}; lane l addresses row l % 8 of
      // matrix l / 8.
      const int matrix = lane / 8;
      const int row = 16 * warp + (matrix & 1) * 8 + (lane & 7);
#pragma unroll
      for (int qq = 0; qq < kChunkCols / 16; ++qq) {
        // Registers of the chunk's 8-column blocks 2qq and 2qq + 1 (4 per block).
        constexpr int kFirst = 4 * (chunk_col(c) / 8);
        const int r = kFirst + 8 * qq;
        ptx::stmatrix_x4(base + swizzled(row, 2 * qq + (matrix >> 1)),
                         pack_pair<Out>(acc[r + 0], acc[r + 1]),
                         pack_pair<Out>(acc[r + 2], acc[r + 3]),
                         pack_pair<Out>(acc[r + 4], acc[r + 5]),
                         pack_pair<Out>(acc[r + 6], acc[r + 7]));
      }
    } else {
      // fp32: each thread owns two adjacent columns of rows r and r + 8 per 8-column block.
      const int row = 16 * warp + lane / 4;
      const int pair = lane % 4;
#pragma unroll
      for (int jj = 0; jj < kChunkCols / 8; ++jj) {
        const int j = chunk_col(c) / 8 + jj;
        const int unit = 2 * jj + pair / 2;
        const uint32_t inner = (pair & 1) * 8;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          ptx::st_shared_v2_f32(base + swizzled(row + 8 * h, unit) + inner, acc[4 * j + 2 * h],
                                acc[4 * j + 2 * h + 1]);
        }
      }
    }
  }

  // Chunks batch0 .. batch0 + kBuffers - 1 into the staging area, chunk batch0 + i in buffer i.
  template <int batch0, int... i>
  __device__ static void write_batch(const float (&acc)[kBlockN / 2], SharedStorage& smem,
                                     std::integer_sequence<int, i...>) {
    (write_chunk<batch0 + i>(acc, ptx::smem_u32(smem.buffer[i])), ...);
  }

  // Stores the warpgroup's block at `to` (the caller skips blocks past to.rows). `barrier`
  // spans the warpgroup; thread 0 of the warpgroup issues (and owns) every store.
  template <int batch0 = 0>
  __device__ static void store(const float (&acc)[kBlockN / 2], SharedStorage& smem,
                               const StorePlan& to, const NamedBarrier& barrier) {
    const bool issuer = threadIdx.x % 128 == 0;
    if (issuer) StorePipeline::producer_acquire();
    barrier.sync();  // the previous batch's stores have read the staging area
    write_batch<batch0>(acc, smem, std::make_integer_sequence<int, kBuffers>{});
    ptx::fence_proxy_async_shared();
    barrier.sync();  // the whole batch is visible to the TMA unit
    if (issuer) {
#pragma unroll
      for (int i = 0; i < kBuffers; ++i) {
        // NOTE: to.col < to.cols, so neither sum wraps past 2^31.
        if (chunk_col(batch0 + i) >= to.cols - to.col) break;  // this chunk and the rest: past D
        ptx::tma_store(to.d, smem.buffer[i],
                       ptx::TmaCoord<4>{{to.col + chunk_col(batch0 + i), to.row, to.batch,
                                         to.split}});
      }
      StorePipeline::producer_commit();
    }
    if constexpr (batch0 + kBuffers < kChunks) store<batch0 + kBuffers>(acc, smem, to, barrier);
  }

  // Stores a block of zeros at `to`, as store() does a block of accumulators.
  template <int batch0 = 0>
  __device__ static void store_zeros(SharedStorage& smem, const StorePlan& to,
                                     const NamedBarrier& barrier) {
    const bool issuer = threadIdx.x % 128 == 0;
    if (issuer) StorePipeline::producer_acquire();
    barrier.sync();
    if constexpr (batch0 == 0) {  // later batches find the zeros the first one wrote
      constexpr int kUnits = kBuffers * kChunkBytes / 16;
#pragma unroll
      for (int u = threadIdx.x % 128; u < kUnits; u += 128) {
        reinterpret_cast<uint4*>(&smem.buffer[0][0])[u] = make_uint4(0, 0, 0, 0);
      }
      ptx::fence_proxy_async_shared();
      barrier.sync();
    }
    if (issuer) {
#pragma unroll
      for (int i = 0; i < kBuffers; ++i) {
        if (chunk_col(batch0 + i) >= to.cols - to.col) break;
        ptx::tma_store(to.d, smem.buffer[i],
                       ptx::TmaCoord<4>{{to.col + chunk_col(batch0 + i), to.row, to.batch,
                                         to.split}});
      }
      StorePipeline::producer_commit();
    }
    if constexpr (batch0 + kBuffers < kChunks) store_zeros<batch0 + kBuffers>(smem, to, barrier);
  }

  // Before the CTA exits: every store issued by this warpgroup has read its staging buffer.
  __device__ static void finish() {
    if (threadIdx.x % 128 == 0) StorePipeline::producer_tail();
  }
};

}  // namespace jax_tma
