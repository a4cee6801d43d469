// Small helpers shared by the PTX wrappers: shared-memory addresses, thread election, and
// computing values early.
#pragma once

#include <cstdint>

namespace jax_tma::ptx {

// 32-bit shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// elect.sync: true in exactly one active lane of the warp.
__device__ __forceinline__ bool elect_one_sync() {
  uint32_t pred = 0;
  asm volatile(
      "{\n"
      ".reg .b32 laneid;\n"
      ".reg .pred p;\n"
      "elect.sync laneid|p, 0xffffffff;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(pred));
  return pred != 0;
}

// An empty asm that reads `values`: they are computed here, before any later volatile asm (a
// barrier, say), instead of where they are first used. Issues loads early.
template <class T, class... Ts>
__device__ __forceinline__ void compute_now(const T& value, const Ts&... values) {
  asm volatile("" ::"r"(static_cast<uint32_t>(value)));
  if constexpr (sizeof...(values) > 0) compute_now(values...);
}

}  // namespace jax_tma::ptx
