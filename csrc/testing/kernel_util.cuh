// Helpers shared by the primitive test kernels of csrc/testing/: shared-memory alignment and
// dumps, timeout reporting, the cluster barrier every thread must reach, and plain / cluster
// launches with a dynamic shared-memory size.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ptx/cluster.cuh"

namespace jax_tma::testing {

// TMA with 128-byte swizzle wants 1024-byte aligned buffers; the tests align every buffer so.
__device__ __forceinline__ uint8_t* align_1024(uint8_t* p) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + 1023) & ~uintptr_t{1023});
}

// Copies `bytes` (a multiple of 16) from shared to global with 16-byte accesses, all threads.
__device__ __forceinline__ void dump_smem(uint8_t* dst, const uint8_t* src, uint32_t bytes) {
  for (uint32_t i = threadIdx.x * 16; i < bytes; i += blockDim.x * 16) {
    *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
  }
}

// A bounded wait gave up: count it where the host reads it back.
__device__ __forceinline__ void report_timeout(int32_t* timeouts) { atomicAdd(timeouts, 1); }

// Cluster barrier reached by every thread of every CTA, whatever role branch it took: the CTA
// barrier first reconverges the warps, as barrier.cluster is .aligned.
__device__ __forceinline__ void cluster_sync_all() {
  __syncthreads();
  ptx::cluster_sync();
}

template <class Kernel, class... Args>
cudaError_t launch_plain(Kernel kernel, int blocks, int threads, uint32_t smem, cudaStream_t stream,
                         Args... args) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<blocks, threads, smem, stream>>>(args...);
  return cudaGetLastError();
}

// One cluster of cluster_x x cluster_y CTAs (the whole grid).
template <class Kernel, class... Args>
cudaError_t launch_one_cluster(Kernel kernel, int cluster_x, int cluster_y, int threads,
                               uint32_t smem, cudaStream_t stream, Args... args) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster_x;
  cluster.val.clusterDim.y = cluster_y;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(cluster_x, cluster_y, 1);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace jax_tma::testing
