// Tensor Memory Accelerator wrappers (cp.async.bulk.tensor and friends).
// Tensor maps are CUtensorMap objects encoded on the host (csrc/ffi/tensor_map.h) and passed
// as `const __grid_constant__` kernel parameters; coordinates are element indices, innermost
// dimension first. Loads complete on an mbarrier (complete_tx::bytes); out-of-bounds box
// elements are zero-filled on load and clipped on store.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "ptx/common.cuh"

namespace jax_tma::ptx {

// prefetch.tensormap: pull the descriptor into the constant cache ahead of the first copy.
__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 2-D tile load global -> shared, completing `box bytes` of transactions on `bar`.
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map,
                                            uint64_t* bar, int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// 2-D tile store shared -> global, tracked by the bulk async-group of the issuing thread.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* smem_src,
                                             int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(smem_src)), "r"(c0), "r"(c1)
      : "memory");
}

// cp.async.bulk.commit_group: close the current bulk async-group of this thread.
__device__ __forceinline__ void tma_store_commit_group() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// cp.async.bulk.wait_group.read: at most kPending groups may still be reading shared memory.
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// fence.proxy.async.shared::cta: generic-proxy writes to shared memory become visible to the
// async proxy (TMA, wgmma) once the writing threads pass a barrier after this fence.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

}  // namespace jax_tma::ptx
