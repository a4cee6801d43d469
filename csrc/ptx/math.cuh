// Math instructions for the fused epilogues, one wrapper per instruction: the fast approximate
// ones (MUFU on the SFU), whose error (ex2.approx: 2 ulp; rcp.approx: 1 ulp) is below the
// rounding of a 16-bit output, and the packed 16-bit sums and products (one instruction for two
// values, each rounded once to the 16-bit type).
#pragma once

#include <cstdint>

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

// add.rn.bf16x2 / add.rn.f16x2: a + b, two values per register, each rounded once.
__device__ __forceinline__ uint32_t add_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t add_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// mul.rn.bf16x2 / mul.rn.f16x2: a * b, two values per register, each rounded once.
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

}  // namespace jax_tma::ptx
