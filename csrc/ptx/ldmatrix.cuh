// ldmatrix and shared-memory vector loads: the epilogue's shared -> register step for an
// operand it combines with the accumulators (the inverse of ptx/stmatrix.cuh's stores, so the
// values land in the accumulators' register layout).
#pragma once

#include <cstdint>

#include "ptx/common.cuh"

namespace jax_tma::ptx {

// ldmatrix.m8n8.x4: four 8x8 b16 matrices; lanes 8i..8i+7 give the shared addresses of rows
// 0..7 of matrix i (16 contiguous bytes each), and register i of every lane receives two
// adjacent elements (lower column in the low half) of row lane/4 of matrix i, columns
// 2 * (lane % 4) and + 1.
struct Fragment4 {
  uint32_t r[4];
};
__device__ __forceinline__ Fragment4 ldmatrix_x4(uint32_t smem_row_addr) {
  Fragment4 f;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
               : "r"(smem_row_addr)
               : "memory");
  return f;
}

// ld.shared.f32: 4 bytes from a shared address (the FP8 mainloop's scales; ordered before the
// stage's release by the clobber).
__device__ __forceinline__ float ld_shared_f32(uint32_t smem_addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(smem_addr) : "memory");
  return v;
}

// ld.shared.v2.f32: 8 bytes from a shared address.
__device__ __forceinline__ float2 ld_shared_v2_f32(uint32_t smem_addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(smem_addr)
               : "memory");
  return v;
}

// ld.shared.v2.b32: 8 bytes from a shared address.
__device__ __forceinline__ uint2 ld_shared_v2_b32(uint32_t smem_addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(smem_addr)
               : "memory");
  return v;
}

// ld.shared.v4.b32: 16 bytes from a shared address (the epilogue warps' unit of a staged block).
__device__ __forceinline__ uint4 ld_shared_v4_b32(uint32_t smem_addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_addr)
               : "memory");
  return v;
}

}  // namespace jax_tma::ptx
