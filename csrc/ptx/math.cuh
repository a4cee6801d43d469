// Fast approximate math instructions for the fused epilogues (MUFU on the SFU): one wrapper per
// instruction. Their error (ex2.approx: 2 ulp; rcp.approx: 1 ulp) is below the rounding of a
// 16-bit output.
#pragma once

namespace jax_tma::ptx {

// ex2.approx.ftz.f32: 2^x
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// rcp.approx.ftz.f32: 1 / x
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace jax_tma::ptx
