// Global-memory flags between CTAs of one grid: a release store that publishes the writes
// before it (of this thread, and of the threads that synchronised with it) at GPU scope, and an
// acquire load that makes them visible to the writes and reads after it.
#pragma once

#include <cstdint>

namespace jax_tma::ptx {

__device__ __forceinline__ void store_release_gpu(uint32_t* ptr, uint32_t value) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_gpu(const uint32_t* ptr) {
  uint32_t value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

}  // namespace jax_tma::ptx
