// Device half of the fused GEMM epilogues (epilogue/fusion.h says what each computes): the
// activations and their derivatives, in fp32. tanh, exp and the reciprocal run on the SFU
// (ptx/math.cuh): their approximation error is below a 16-bit output's rounding, and the
// library's accurate forms kept the epilogue of a 128 x 256 tile long enough to cost the
// product ~10 % (gelu on 16384 x 14336 x 4096, H100).
#pragma once

#include <cstdint>

#include "epilogue/fusion.h"
#include "ptx/math.cuh"

namespace jax_tma {

// The logistic function 1 / (1 + e^-z) on the SFU: e^-z = 2^(-z log2 e).
__device__ __forceinline__ float sigmoid(float z) {
  return ptx::rcp_approx(1.0f + ptx::exp2_approx(-1.4426950408889634f * z));
}

template <Activation kAct>
__device__ __forceinline__ float activate(float z) {
  if constexpr (kAct == Activation::kRelu) {
    return fmaxf(z, 0.0f);
  } else if constexpr (kAct == Activation::kGeluTanh) {
    // 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))) = h + h tanh(z (c + c 0.044715 z^2)),
    // h = z / 2: five FP32 operations beside the tanh.
    const float h = 0.5f * z;
    const float inner = z * fmaf(0.7978845608028654f * 0.044715f, z * z, 0.7978845608028654f);
    return fmaf(h, ptx::tanh_approx(inner), h);
  } else if constexpr (kAct == Activation::kGeluErf) {
    return 0.5f * z * (1.0f + erff(z * 0.7071067811865476f));
  } else if constexpr (kAct == Activation::kSilu) {
    return z * sigmoid(z);
  } else {
    return z;
  }
}

// d act / dz at z.
template <Activation kAct>
__device__ __forceinline__ float activate_grad(float z) {
  if constexpr (kAct == Activation::kRelu) {
    return z > 0.0f ? 1.0f : 0.0f;
  } else if constexpr (kAct == Activation::kGeluTanh) {
    const float z2 = z * z;
    const float t = ptx::tanh_approx(0.7978845608028654f * fmaf(0.044715f * z, z2, z));
    const float dinner = 0.7978845608028654f * fmaf(3.0f * 0.044715f, z2, 1.0f);
    return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * dinner;
  } else if constexpr (kAct == Activation::kGeluErf) {
    // Phi(z) + z phi(z)
    return 0.5f * (1.0f + erff(z * 0.7071067811865476f)) +
           z * 0.3989422804014327f * ptx::exp2_approx(-0.7213475204444817f * z * z);
  } else if constexpr (kAct == Activation::kSilu) {
    const float s = sigmoid(z);
    return s * (1.0f + z * (1.0f - s));
  } else {
    return 1.0f;
  }
}

}  // namespace jax_tma
