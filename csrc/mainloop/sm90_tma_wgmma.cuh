// Mainloop of the sm90 GEMM: TMA fills a ring of (A, B) stages, two consumer warpgroups run
// wgmma on them.
//
// Shared-memory layouts (both 128-byte swizzled, each stage 1024-byte aligned):
//   A stage: kBlockM rows x 64 K-elements, K-major (one 128-byte row per M index).
//   B stage: kBlockN / 64 column blocks, each 64 K-rows x 64 N-elements, N-major.
// Consumer warpgroup g multiplies A rows [64g, 64g + 64) by the whole B stage.
//
// Clusters (Tile::kClusterM = 2): both CTAs of a cluster work on the same N block and K range,
// so their B slices are equal. When both M blocks exist (LoadMode::kMulticast) each CTA loads
// half of B's column blocks and multicasts them to both; when the peer's M block lies past the
// matrix, this CTA loads all of B itself (kSolo) and the peer only keeps its ring in step
// (kIdle: no copies, an arrival with no bytes). Every consumer warp releases each stage to the
// empty barriers of all CTAs of the cluster, whatever the mode, so a producer never multicasts
// into a peer stage that the peer has not yet re-armed; empty barriers count
// consumer warps x cluster CTAs.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "pipeline/tma_pipeline.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace jax_tma {

enum class LoadMode { kMulticast, kSolo, kIdle };

template <class T, class Tile>
struct MainloopSm90TmaWgmma {
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kBlockK = Tile::kBlockK;
  static constexpr int kStages = Tile::kStages;
  static constexpr int kClusterM = Tile::kClusterM;
  static constexpr uint32_t kClusterMask = (1u << kClusterM) - 1;
  static constexpr int kWgmmaK = 16;
  static constexpr int kAccRegs = kBlockN / 2;
  // B column block: 64 K-rows of one 128-byte swizzle row each.
  static constexpr int kBColumnBlockElems = 64 * kBlockK;

  using Pipeline = PipelineTmaAsync<kStages>;
  using State = typename Pipeline::State;
  using Mma = ptx::WgmmaSS<kBlockN, T>;

  struct SharedStorage {
    alignas(1024) T a[kStages][kBlockM * kBlockK];
    alignas(1024) T b[kStages][kBlockK * kBlockN];
  };
  static_assert(sizeof(T) == Tile::kElementBytes);
  static_assert(sizeof(SharedStorage::a[0]) == Tile::kTileABytes);
  static_assert(sizeof(SharedStorage::b[0]) == Tile::kTileBBytes);
  static_assert(kBlockK * sizeof(T) == 128, "one K slice is one 128-byte swizzle row");

  // Producer (one thread): stream K slices [kb_begin, kb_end) of one output tile into the ring.
  // `rank` is this CTA's rank in its cluster.
  __device__ static void load(Pipeline& pipeline, State& write, SharedStorage& smem,
                              const CUtensorMap* tmap_a, const CUtensorMap* tmap_b, int m0,
                              int n0, int kb_begin, int kb_end, LoadMode mode, int rank) {
#pragma unroll 1
    for (int kb = kb_begin; kb < kb_end; ++kb) {
      pipeline.producer_acquire(write);
      if (mode == LoadMode::kIdle) {
        pipeline.producer_expect_tx(write, 0);
        ++write;
        continue;
      }
      // Whoever issues them, every byte of A and B lands in this CTA's stage.
      uint64_t* full = pipeline.producer_expect_tx(write, Tile::kStageBytes);
      const int k0 = kb * kBlockK;
      ptx::tma_load_2d(smem.a[write.index], tmap_a, full, k0, m0);
#pragma unroll
      for (int j = 0; j < Tile::kBColumnBlocks; ++j) {
        T* dst = smem.b[write.index] + j * kBColumnBlockElems;
        if (mode == LoadMode::kSolo) {
          ptx::tma_load_2d(dst, tmap_b, full, n0 + 64 * j, k0);
        } else if (j % kClusterM == rank) {
          ptx::tma_load_2d_multicast(dst, tmap_b, full, kClusterMask, n0 + 64 * j, k0);
        }
      }
      ++write;
    }
  }

  // One K slice: four wgmma k16 steps on stage `stage` into `acc`.
  __device__ static void issue(const SharedStorage& smem, int stage, int warpgroup,
                               float (&acc)[kAccRegs], bool overwrite) {
    const T* a = smem.a[stage] + warpgroup * 64 * kBlockK;
    const T* b = smem.b[stage];
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / kWgmmaK; ++kk) {
      // K-major A: the k16 step moves 32 bytes along the swizzled row; 8-row groups are
      // 1024 bytes apart.
      const uint64_t desc_a =
          ptx::make_smem_desc(a + kk * kWgmmaK, 0, 1024, ptx::WgmmaSwizzle::k128B);
      // N-major B: the k16 step moves 16 rows of 128 bytes; 64-column blocks are one column
      // block apart, 8-row groups 1024 bytes apart.
      const uint64_t desc_b =
          ptx::make_smem_desc(b + kk * kWgmmaK * 64, kBColumnBlockElems * sizeof(T), 1024,
                              ptx::WgmmaSwizzle::k128B);
      Mma::template mma<0, 1>(acc, desc_a, desc_b, (overwrite && kk == 0) ? 0 : 1);
    }
    ptx::wgmma_commit_group();
  }

  // Every lane of a consumer warp: this warp is done reading the stage.
  __device__ static void release(Pipeline& pipeline, const State& s) {
    if constexpr (kClusterM == 1) {
      if (threadIdx.x % 32 == 0) pipeline.consumer_release(s);
    } else {
      pipeline.consumer_release_cluster(s, kClusterMask);
    }
  }

  // Consumer warpgroup: accumulate one output tile over `k_blocks` (>= 1) slices. Keeps one
  // wgmma group in flight and releases each stage as soon as the group reading it has retired.
  __device__ static void mma(Pipeline& pipeline, State& read, const SharedStorage& smem,
                             int warpgroup, int k_blocks, float (&acc)[kAccRegs]) {
    pipeline.consumer_wait(read);
    ptx::wgmma_fence_operands(acc);
    issue(smem, read.index, warpgroup, acc, true);
    State in_flight = read;
    ++read;
#pragma unroll 1
    for (int kb = 1; kb < k_blocks; ++kb) {
      pipeline.consumer_wait(read);
      issue(smem, read.index, warpgroup, acc, false);
      ptx::wgmma_wait_group<1>();
      release(pipeline, in_flight);
      in_flight = read;
      ++read;
    }
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(acc);
    release(pipeline, in_flight);
  }

  // Consumer warpgroup of an idle CTA (LoadMode::kIdle): pass through the tile's stages.
  __device__ static void skip(Pipeline& pipeline, State& read, int k_blocks) {
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb) {
      pipeline.consumer_wait(read);
      release(pipeline, read);
      ++read;
    }
  }
};

}  // namespace jax_tma
