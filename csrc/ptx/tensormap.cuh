// Tensor maps that live in global memory and are edited on the device (grouped / ragged GEMM):
// in-place field updates with tensormap.replace, and the proxy fences that publish an edited
// map to the TMA unit. A map is 128 bytes, 64-byte aligned.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "ptx/common.cuh"

namespace jax_tma::ptx {

// Copy a 128-byte map (e.g. a __grid_constant__ kernel parameter) to global memory, where
// tensormap.replace can edit it. Generic-proxy stores: publish with fence_tensormap_release.
__device__ __forceinline__ void tensormap_copy(CUtensorMap* gmem_dst, const CUtensorMap* src) {
  const uint4* from = reinterpret_cast<const uint4*>(src);
  uint4* to = reinterpret_cast<uint4*>(gmem_dst);
#pragma unroll
  for (int i = 0; i < 8; ++i) to[i] = from[i];
}

// tensormap.replace .global_address on a map in global memory.
__device__ __forceinline__ void tensormap_replace_global_address(CUtensorMap* gmem_map,
                                                                 const void* address) {
  asm volatile("tensormap.replace.tile.global_address.global.b1024.b64 [%0], %1;" ::"l"(
                   reinterpret_cast<uint64_t>(gmem_map)),
               "l"(reinterpret_cast<uint64_t>(address))
               : "memory");
}

// tensormap.replace .global_dim: size of dimension kDim (innermost = 0) in elements.
template <int kDim>
__device__ __forceinline__ void tensormap_replace_global_dim(CUtensorMap* gmem_map,
                                                             uint32_t size) {
  asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], %1, %2;" ::"l"(
                   reinterpret_cast<uint64_t>(gmem_map)),
               "n"(kDim), "r"(size)
               : "memory");
}

// tensormap.replace .global_stride: byte stride of dimension kDim + 1.
template <int kDim>
__device__ __forceinline__ void tensormap_replace_global_stride(CUtensorMap* gmem_map,
                                                                uint64_t stride_bytes) {
  asm volatile("tensormap.replace.tile.global_stride.global.b1024.b64 [%0], %1, %2;" ::"l"(
                   reinterpret_cast<uint64_t>(gmem_map)),
               "n"(kDim), "l"(stride_bytes)
               : "memory");
}

// Release the writer's generic-proxy edits of the map to the tensormap proxy (GPU scope).
__device__ __forceinline__ void fence_tensormap_release() {
  asm volatile("fence.proxy.tensormap::generic.release.gpu;" ::: "memory");
}

// Acquire an edited map before the first TMA through it (GPU scope, 128-byte map).
__device__ __forceinline__ void fence_tensormap_acquire(const CUtensorMap* gmem_map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(
                   reinterpret_cast<uint64_t>(gmem_map))
               : "memory");
}

}  // namespace jax_tma::ptx
