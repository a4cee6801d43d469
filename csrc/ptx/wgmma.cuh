// Warpgroup matrix multiply (wgmma) support: shared-memory matrix descriptors, the
// fence/commit/wait instructions, and the mma wrappers generated in wgmma_ops.cuh.
//
// Accumulator layout of m64nNk16 (fp32), per thread t of the 128-thread warpgroup, warp
// w = t / 32, lane l: register 4*j + 2*h + c holds row 16*w + l/4 + 8*h, column
// 8*j + 2*(l%4) + c, for j in [0, N/8), h, c in {0, 1}.
#pragma once

#include <cstdint>

#include "ptx/common.cuh"
#include "ptx/wgmma_ops.cuh"

namespace jax_tma::ptx {

// Swizzle modes as encoded in bits 62-63 of the descriptor.
enum class WgmmaSwizzle : uint64_t { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

// A descriptor's layout fields (leading and stride offsets, swizzle): a constant per operand
// layout, so a mainloop may build them once and advance the address field alone.
__host__ __device__ constexpr uint64_t smem_desc_layout(uint32_t leading_bytes,
                                                        uint32_t stride_bytes,
                                                        WgmmaSwizzle swizzle) {
  return (static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32) |
         (static_cast<uint64_t>(swizzle) << 62);
}

// A descriptor's start address field: the shared-memory address / 16, 14 bits (a tile `n`
// bytes further starts `n / 16` higher, within shared memory's 256 KB).
__device__ __forceinline__ uint32_t smem_desc_address(const void* smem) {
  return (smem_u32(smem) & 0x3FFFF) >> 4;
}

// Matrix descriptor for an operand tile in shared memory. Offsets are in bytes:
//  K-major, swizzled: `stride_bytes` is the distance between 8-row groups along M/N
//                     (leading offset unused).
//  MN-major, swizzled: `leading_bytes` is the distance between swizzle-wide column blocks
//                      along M/N, `stride_bytes` the distance between 8-row groups along K.
__device__ __forceinline__ uint64_t make_smem_desc(const void* smem, uint32_t leading_bytes,
                                                   uint32_t stride_bytes, WgmmaSwizzle swizzle) {
  return smem_desc_address(smem) | smem_desc_layout(leading_bytes, stride_bytes, swizzle);
}

// wgmma.fence: orders register accesses to the accumulators before the next wgmma.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

// wgmma.commit_group: closes the group of wgmma issued since the previous commit.
__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// wgmma.wait_group: at most kPending committed groups may still be in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across a wgmma boundary.
template <int kRegs>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace jax_tma::ptx
