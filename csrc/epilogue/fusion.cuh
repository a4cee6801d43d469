// Device half of the fused GEMM epilogues (epilogue/fusion.h says what each computes): the
// activations and their derivatives, in fp32. exp and the reciprocal run on the SFU
// (ptx/math.cuh): their approximation error is below a 16-bit output's rounding, and the
// library's accurate tanh kept the epilogue of a 128 x 256 tile long enough to cost the
// product ~10 % (gelu on 16384 x 14336 x 4096, H100). The exact GELU's erf is the library's
// (compiled for the narrow tiles only).
#pragma once

#include <cstdint>

#include "epilogue/fusion.h"
#include "ptx/math.cuh"

namespace jax_tma {

constexpr float kLog2e = 1.4426950408889634f;

// e^-z on the SFU: 2^(-z log2 e).
__device__ __forceinline__ float exp_neg(float z) { return ptx::exp2_approx(-kLog2e * z); }

// The logistic function 1 / (1 + e^-z). Accurate to a few ulp relative over the whole range
// (e^-z overflows to inf where the result is below fp32's smallest normal, and the reciprocal
// gives 0).
__device__ __forceinline__ float sigmoid(float z) { return ptx::rcp_approx(1.0f + exp_neg(z)); }

// The tanh-approximated GELU is z sigmoid(v), v = 2 sqrt(2/pi) (z + 0.044715 z^3) (v's
// derivative in z: activate_and_grad). e^-v = 2^(-v log2 e), with -log2 e folded into the
// polynomial's coefficients (one multiplication a value fewer than exp_neg(v)).
constexpr float kGeluTanhScale2 = 2.0f * 0.7978845608028654f;
__device__ __forceinline__ float gelu_tanh_exp_neg_arg2(float z) {
  return ptx::exp2_approx(
      z * fmaf(-kLog2e * kGeluTanhScale2 * 0.044715f, z * z, -kLog2e * kGeluTanhScale2));
}

// NOTE: the tanh GELU is written without cancellation: 0.5 z (1 + tanh(u)) equals z sigmoid(2u).
// Where z < -3, 1 + tanh(u) is a sum of nearly opposite terms, and tanh.approx's 2^-11 error
// left less than one correct bit of GELU's value there (z = -4: -7.0e-5); the sigmoid form
// computes it to a few ulp. The exact GELU keeps 1 + erf(z / sqrt 2), erff being accurate to
// 2 ulp: within a bf16 rounding down to z = -4 (below, |GELU(z)| < 1.3e-4 and the relative
// error grows). erfcf's form has no such limit but spilled registers on every exact-GELU
// kernel (4-248 bytes a thread).
template <Activation kAct>
__device__ __forceinline__ float activate(float z) {
  if constexpr (kAct == Activation::kRelu) {
    return fmaxf(z, 0.0f);
  } else if constexpr (kAct == Activation::kGeluTanh) {
    return z * ptx::rcp_approx(1.0f + gelu_tanh_exp_neg_arg2(z));  // z sigmoid(v)
  } else if constexpr (kAct == Activation::kGeluErf) {
    return 0.5f * z * (1.0f + erff(z * 0.7071067811865476f));
  } else if constexpr (kAct == Activation::kSilu) {
    return z * sigmoid(z);
  } else {
    return z;
  }
}

// (act(z), d act / dz at z), sharing the SFU operations of the two.
template <Activation kAct>
__device__ __forceinline__ float2 activate_and_grad(float z) {
  if constexpr (kAct == Activation::kRelu) {
    return make_float2(fmaxf(z, 0.0f), z > 0.0f ? 1.0f : 0.0f);
  } else if constexpr (kAct == Activation::kGeluTanh) {
    // d/dz z s(v) = s + z s (1 - s) v', v = 2u. 1 - s is e s with e = e^-v where s >= 1/2
    // (e <= 1; 1 - s would cancel), else 1 - s (e may be inf there).
    const float e = gelu_tanh_exp_neg_arg2(z);
    const float s = ptx::rcp_approx(1.0f + e);
    const float rest = s >= 0.5f ? e * s : 1.0f - s;
    const float dv = fmaf(kGeluTanhScale2 * 3.0f * 0.044715f, z * z, kGeluTanhScale2);
    return make_float2(z * s, s * fmaf(z * rest, dv, 1.0f));
  } else if constexpr (kAct == Activation::kGeluErf) {
    // z Phi(z), and Phi(z) + z phi(z)
    const float phi = 0.5f * (1.0f + erff(z * 0.7071067811865476f));
    return make_float2(z * phi, phi + z * 0.3989422804014327f *
                                          ptx::exp2_approx(-0.7213475204444817f * z * z));
  } else if constexpr (kAct == Activation::kSilu) {
    const float s = sigmoid(z);
    return make_float2(z * s, s * (1.0f + z * (1.0f - s)));
  } else {
    return make_float2(z, 1.0f);
  }
}

// d act / dz at z.
template <Activation kAct>
__device__ __forceinline__ float activate_grad(float z) {
  return activate_and_grad<kAct>(z).y;
}

}  // namespace jax_tma
