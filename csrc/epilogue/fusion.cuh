// Device half of the fused GEMM epilogues (epilogue/fusion.h says what each computes): the
// activations and their derivatives, in fp32.
#pragma once

#include <cstdint>

#include "epilogue/fusion.h"

namespace jax_tma {

template <Activation kAct>
__device__ __forceinline__ float activate(float z) {
  if constexpr (kAct == Activation::kRelu) {
    return fmaxf(z, 0.0f);
  } else if constexpr (kAct == Activation::kGeluTanh) {
    // 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))
    const float inner = 0.7978845608028654f * fmaf(0.044715f * z, z * z, z);
    return 0.5f * z * (1.0f + tanhf(inner));
  } else if constexpr (kAct == Activation::kGeluErf) {
    return 0.5f * z * (1.0f + erff(z * 0.7071067811865476f));
  } else if constexpr (kAct == Activation::kSilu) {
    return z / (1.0f + __expf(-z));
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
    const float t = tanhf(0.7978845608028654f * fmaf(0.044715f * z, z2, z));
    const float dinner = 0.7978845608028654f * fmaf(3.0f * 0.044715f, z2, 1.0f);
    return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * dinner;
  } else if constexpr (kAct == Activation::kGeluErf) {
    // Phi(z) + z phi(z)
    return 0.5f * (1.0f + erff(z * 0.7071067811865476f)) +
           z * 0.3989422804014327f * __expf(-0.5f * z * z);
  } else if constexpr (kAct == Activation::kSilu) {
    const float s = 1.0f / (1.0f + __expf(-z));
    return s * (1.0f + z * (1.0f - s));
  } else {
    return 1.0f;
  }
}

}  // namespace jax_tma
