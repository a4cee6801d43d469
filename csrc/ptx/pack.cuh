// Two fp32 values in one 32-bit register as a pair of 16-bit values (bf16 or fp16), and back:
// the register layout stmatrix stores and ldmatrix loads for 16-bit outputs (the lower-indexed
// column in the low half). One wrapper per conversion; pack_pair / unpack_pair pick one by type.
// Packing rounds to nearest even (cvt.rn); unpacking is exact.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jax_tma::ptx {

// cvt.rn.bf16x2.f32: lo and hi rounded to bf16, lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// cvt.rn.f16x2.f32: lo and hi rounded to fp16, lo in the low half.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The two bf16 values of v as fp32 (low half first).
__device__ __forceinline__ float2 unpack_bf16x2(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}

// The two fp16 values of v as fp32 (low half first).
__device__ __forceinline__ float2 unpack_f16x2(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// pack_bf16x2 / pack_f16x2 for the 16-bit type Out.
template <class Out>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
  return pack_bf16x2(lo, hi);
}
template <>
__device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
  return pack_f16x2(lo, hi);
}

// unpack_bf16x2 / unpack_f16x2 for the 16-bit type Out.
template <class Out>
__device__ __forceinline__ float2 unpack_pair(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack_pair<__nv_bfloat16>(uint32_t v) {
  return unpack_bf16x2(v);
}
template <>
__device__ __forceinline__ float2 unpack_pair<__half>(uint32_t v) {
  return unpack_f16x2(v);
}

}  // namespace jax_tma::ptx
