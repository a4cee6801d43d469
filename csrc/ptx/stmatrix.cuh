// stmatrix: warp-wide stores of 8x8 matrices of 16-bit elements from the mma register
// fragment into shared memory (the epilogue's register -> shared step).
#pragma once

#include <cstdint>

#include "ptx/common.cuh"

namespace jax_tma::ptx {

// stmatrix.m8n8.x4: four 8x8 b16 matrices. Register i of every lane holds two adjacent
// elements (lower column in the low half) of row lane/4 of matrix i; lanes 8i..8i+7 give the
// shared addresses of rows 0..7 of matrix i (16 contiguous bytes each).
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_row_addr, uint32_t r0, uint32_t r1,
                                            uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                   smem_row_addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// st.shared.v2.f32: 8 bytes at a shared address.
__device__ __forceinline__ void st_shared_v2_f32(uint32_t smem_addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(smem_addr), "f"(x), "f"(y) : "memory");
}

// st.shared.v2.b32: 8 bytes at a shared address.
__device__ __forceinline__ void st_shared_v2_b32(uint32_t smem_addr, uint2 v) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(smem_addr), "r"(v.x), "r"(v.y)
               : "memory");
}

// st.shared.v4.b32: 16 bytes at a shared address.
__device__ __forceinline__ void st_shared_v4_b32(uint32_t smem_addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace jax_tma::ptx
