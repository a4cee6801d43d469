// sm90 GEMM kernel, host side: launches one instantiation of kernels/sm90_gemm_kernel.cuh with its
// dynamic shared-memory attribute and cluster shape, on a persistent grid bounded by how many of
// its clusters can be resident at once; launch_dense sizes the dense problem's tile schedule
// (and stream-K's workspace) from the launch arguments of contract/sm90_gemm.h.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "contract/sm90_gemm.h"
#include "epilogue/fusion.h"
#include "kernels/sm90_gemm_kernel.cuh"
#include "kernels/sm90_gemm_problems.cuh"
#include "mainloop/sm90_tma_wgmma.cuh"

namespace jax_tma::sm90_gemm {

// How many clusters of `config`'s shape can be resident at once, queried once per device.
template <class KernelFn>
cudaError_t max_resident_clusters(KernelFn kernel, cudaLaunchConfig_t config, int* clusters) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];  // 0: not yet queried
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < kMaxDevices && cached[device].load(std::memory_order_relaxed) > 0) {
    *clusters = cached[device].load(std::memory_order_relaxed);
    return cudaSuccess;
  }
  config.gridDim = dim3(config.attrs[0].val.clusterDim.x);
  int found = 0;
  err = cudaOccupancyMaxActiveClusters(&found, kernel, &config);
  if (err != cudaSuccess) return err;
  if (found < 1) return cudaErrorInvalidConfiguration;
  if (device < kMaxDevices) cached[device].store(found, std::memory_order_relaxed);
  *clusters = found;
  return cudaSuccess;
}

// Launches one instantiation of the kernel for any problem: its shared-memory attribute, its
// cluster shape, and how many of its clusters can be resident at once (the persistent grid's
// bound).
template <class In, class Out, class Tile, class Layout, template <class> class ProblemT,
          class FusionT = PlainFusion, class MainloopT = TmaWgmmaMainloop>
class Launcher {
 public:
  using K = Kernel<In, Out, Tile, Layout, ProblemT, FusionT, MainloopT>;

  Launcher(const Launcher&) = delete;  // config_ points at cluster_
  Launcher() = default;

  cudaError_t init(int num_sms, cudaStream_t stream) {
    // NOTE: the attribute is per function and device; setting it again is cheap and keeps the
    // launcher free of shared state.
    cudaError_t err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           K::kSmemBytes);
    if (err != cudaSuccess) return err;
    cluster_.id = cudaLaunchAttributeClusterDimension;
    cluster_.val.clusterDim.x = Tile::kClusterM;
    cluster_.val.clusterDim.y = 1;
    cluster_.val.clusterDim.z = 1;
    config_.blockDim = dim3(Tile::kThreads);
    config_.dynamicSmemBytes = K::kSmemBytes;
    config_.stream = stream;
    config_.attrs = &cluster_;
    config_.numAttrs = Tile::kClusterM > 1 ? 1 : 0;
    // Persistent: no more clusters than can be resident at once (GPCs may leave SMs unpaired).
    resident_ = num_sms / Tile::kClusterM;
    if constexpr (Tile::kClusterM > 1) return max_resident_clusters(kKernel, config_, &resident_);
    return cudaSuccess;
  }

  int resident() const { return resident_; }

  cudaError_t launch(int clusters, const LaunchArgs& args,
                     const typename K::Problem::Params& params,
                     const typename K::Partials& partials, const FusedParams& fused = {},
                     const typename K::Mainloop::Params& mainloop = {}) {
    config_.gridDim = dim3(clusters * Tile::kClusterM);
    return cudaLaunchKernelEx(&config_, kKernel, *args.tmap_a, *args.tmap_b, *args.tmap_d,
                              static_cast<Out*>(args.d), args.shape, params, partials, fused,
                              mainloop);
  }

 private:
  static constexpr auto kKernel =
      &sm90_gemm_kernel<In, Out, Tile, Layout, ProblemT, FusionT, MainloopT>;
  cudaLaunchAttribute cluster_{};
  cudaLaunchConfig_t config_{};
  int resident_ = 0;
};

// The dense batched product, with a fused epilogue's parameters (PlainFusion: none) and the
// mainloop's (TmaWgmmaMainloop: none).
template <class In, class Out, class Tile, class Layout, class Fusion = PlainFusion,
          class MainloopT = TmaWgmmaMainloop>
cudaError_t launch_dense(const LaunchArgs& args, const FusedParams& fused,
                         const typename Kernel<In, Out, Tile, Layout, DenseGemm, Fusion,
                                               MainloopT>::Mainloop::Params& mainloop = {}) {
  Launcher<In, Out, Tile, Layout, DenseGemm, Fusion, MainloopT> launcher;
  using K = typename decltype(launcher)::K;
  cudaError_t err = launcher.init(args.num_sms, args.stream);
  if (err != cudaSuccess) return err;
  // Stream-K: the whole grid shares the last wave, as far as the workspace reaches.
  int stream_k_ctas = 0;
  if (Tile::kStreamK && args.stream_k) {
    stream_k_ctas = static_cast<int>(std::min<int64_t>(
        launcher.resident(),
        stream_k_capacity(args.workspace_bytes, Tile::kBlockM, Tile::kBlockN)));
  }
  const int k_blocks =
      static_cast<int>((int64_t{args.shape.k} + Tile::kBlockK - 1) / Tile::kBlockK);
  const int grid_clusters = stream_k_ctas > 0 ? stream_k_ctas : launcher.resident();
  const int group_rows = K::Scheduler::group_rows_for(grid_clusters * Tile::kClusterM);
  const auto tiles = K::Scheduler::make_params(args.shape.m, args.shape.n, args.shape.batch,
                                               args.shape.splits, k_blocks,
                                               args.shape.k_blocks_per_split, stream_k_ctas,
                                               group_rows);
  typename K::Partials partials{nullptr, nullptr};
  int clusters = std::max(1, std::min(tiles.num_units, launcher.resident()));
  if (tiles.sk_ctas > 0) {
    clusters = stream_k_ctas;
    auto* base = static_cast<uint8_t*>(args.workspace);
    partials.flags = reinterpret_cast<uint32_t*>(base);
    partials.slots = reinterpret_cast<float4*>(base + stream_k_flag_bytes(stream_k_ctas));
    err = cudaMemsetAsync(base, 0, stream_k_flag_bytes(stream_k_ctas), args.stream);
    if (err != cudaSuccess) return err;
  }
  return launcher.launch(clusters, args, tiles, partials, fused, mainloop);
}

template <class In, class Out, class Tile, class Layout>
cudaError_t launch(const LaunchArgs& args) {
  return launch_dense<In, Out, Tile, Layout>(args, FusedParams{});
}

}  // namespace jax_tma::sm90_gemm
