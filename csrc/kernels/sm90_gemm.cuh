// sm90 GEMM kernel: D = A @ B with TMA loads, an mbarrier pipeline and wgmma.
//
// Warp-specialised and persistent: warpgroup 0 produces (one elected thread issues every TMA
// copy), warpgroups 1 and 2 consume (wgmma into fp32 registers, then the epilogue). The grid
// walks output tiles through the grouped scheduler. Out-of-bounds rows, columns and K are
// zero-filled by TMA on the way in and clipped by the epilogue on the way out.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "epilogue/direct_store.cuh"
#include "kernels/sm90_gemm.h"
#include "mainloop/sm90_tma_wgmma.cuh"
#include "ptx/common.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/warpgroup.cuh"
#include "scheduler/tile_scheduler.cuh"

namespace jax_tma::sm90_gemm {

enum class WarpGroupRole { Producer = 0, Consumer0 = 1, Consumer1 = 2 };

// NOTE: 40 + 2 * 232 registers per thread-slot fit the 64K register file at 384 threads.
inline constexpr int kProducerRegs = 40;
inline constexpr int kConsumerRegs = 232;

template <class In, class Out, class Tile>
struct Kernel {
  using Mainloop = MainloopSm90TmaWgmma<In, Tile>;
  using Pipeline = typename Mainloop::Pipeline;
  using Scheduler = GroupedTileScheduler<Tile::kBlockM, Tile::kBlockN>;
  using Epilogue = DirectStoreEpilogue<Out, Tile::kBlockN>;

  struct SharedStorage {
    typename Mainloop::SharedStorage operands;
    typename Pipeline::SharedStorage barriers;
  };
  // The base is aligned up by at most 1023 bytes inside the dynamic allocation.
  static_assert(offsetof(SharedStorage, barriers) + sizeof(typename Pipeline::SharedStorage) +
                    1023 <=
                Tile::kSmemBytes);
  static constexpr int kConsumerWarps = 4 * Tile::kConsumerWarpgroups;
};

template <class In, class Out, class Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    sm90_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                     const __grid_constant__ CUtensorMap tmap_b, Out* __restrict__ d,
                     GemmShape shape) {
  using K = Kernel<In, Out, Tile>;
  extern __shared__ uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<typename K::SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});

  const auto role = static_cast<WarpGroupRole>(threadIdx.x / 128);
  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&tmap_a);
    ptx::prefetch_tensormap(&tmap_b);
    K::Pipeline::init(smem.barriers, K::kConsumerWarps);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();

  typename K::Pipeline pipeline{smem.barriers};
  const typename K::Scheduler scheduler(shape.m, shape.n);
  const int k_blocks = (shape.k + Tile::kBlockK - 1) / Tile::kBlockK;

  if (role == WarpGroupRole::Producer) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x / 32 == 0 && ptx::elect_one_sync()) {
      auto write = make_producer_start_state<Tile::kStages>();
      for (auto t = scheduler.first(); scheduler.valid(t); t = scheduler.next(t)) {
        K::Mainloop::load(pipeline, write, smem.operands, &tmap_a, &tmap_b,
                          t.m_block * Tile::kBlockM, t.n_block * Tile::kBlockN, k_blocks);
      }
      pipeline.producer_tail(write);
    }
  } else {
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int warpgroup = static_cast<int>(role) - static_cast<int>(WarpGroupRole::Consumer0);
    auto read = make_consumer_start_state<Tile::kStages>();
    float acc[K::Mainloop::kAccRegs];
    for (auto t = scheduler.first(); scheduler.valid(t); t = scheduler.next(t)) {
      K::Mainloop::mma(pipeline, read, smem.operands, warpgroup, k_blocks, acc);
      K::Epilogue::store(acc, d, shape.m, shape.n, shape.ldd,
                         t.m_block * Tile::kBlockM + 64 * warpgroup, t.n_block * Tile::kBlockN);
    }
  }
}

template <class In, class Out, class Tile>
cudaError_t launch(const LaunchArgs& args) {
  auto* kernel = &sm90_gemm_kernel<In, Out, Tile>;
  // NOTE: the attribute is per function and device; setting it again is cheap and keeps the
  // launcher free of shared state.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Tile::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int m_blocks = (args.shape.m + Tile::kBlockM - 1) / Tile::kBlockM;
  const int n_blocks = (args.shape.n + Tile::kBlockN - 1) / Tile::kBlockN;
  const int tiles = m_blocks * n_blocks;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(std::max(1, std::min(tiles, args.num_sms)));
  config.blockDim = dim3(Tile::kThreads);
  config.dynamicSmemBytes = Tile::kSmemBytes;
  config.stream = args.stream;
  return cudaLaunchKernelEx(&config, kernel, *args.tmap_a, *args.tmap_b,
                            static_cast<Out*>(args.d), args.shape);
}

}  // namespace jax_tma::sm90_gemm
