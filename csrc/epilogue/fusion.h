// What a fused GEMM epilogue computes (the host-visible half: kinds, activations, run-time
// arguments; the device functions are in epilogue/fusion.cuh).
//
//   Plain            out = acc
//   BiasActivation   z = acc + bias[col] (bias optional, fp32); out = act(z) (+ aux[row, col],
//                    the residual, optional); the pre-activation z may be stored as a second
//                    output (for the backward pass)
//   ActivationGrad   out = acc * act'(aux[row, col]): the cotangent of a pre-activation, where
//                    acc = dy @ w^T (rounded to the output type first, as unfused) and aux = the
//                    saved pre-activation z
//   Gated            the accumulator's 64-column blocks alternate gate and up columns of the same
//                    output columns: out = act(gate) * up (one output block per two accumulator
//                    blocks); gate and up may be stored as two more outputs (backward pass)
//   GatedGrad        the gated product's backward: acc = dh = dy @ w_down^T (rounded to the
//                    output type first, as unfused), aux = the saved gate pre-activation g, aux2
//                    = the up's u; out = dh * u * act'(g) (the gate's cotangent) and a second
//                    output dh * act(g) (the up's)
//   Scaled           out = acc * row_scale[row] * col_scale[col] + bias[col], each factor
//                    optional (fp32), a scale vector possibly one value for all: the scales
//                    of FP8 products (per tensor, row or column) that factor out of the sum
//                    over K, and a bias
// Activations: relu, gelu (tanh approximation, as jax.nn.gelu; or erf, exact), silu. The aux
// operand arrives through TMA in the epilogue's staging buffer (epilogue/tma_store.cuh), or in
// the epilogue warps' ring (GatedGrad always: epilogue/epilogue_warps.cuh).
// BiasActivation and Gated round to the (16-bit) output type where the unfused expression
// rounds: the product(s), the bias sum, the activation (gated: before the product with up), the
// residual sum; each operation in fp32. On cooperative tiles the epilogue warps apply them to
// the staged block (epilogue/epilogue_warps.cuh) unless a residual is read.
#pragma once

#include <cstdint>

namespace jax_tma {

enum class Activation : int { kNone = 0, kRelu = 1, kGeluTanh = 2, kGeluErf = 3, kSilu = 4 };

enum class FusionKind : int {
  kPlain = 0,
  kBiasActivation = 1,
  kActivationGrad = 2,
  kGated = 3,
  kScaled = 4,
  kGatedGrad = 5
};

// The element type of a bias vector: fp32, or a 16-bit type widened to fp32 as it is read
// (so that a bf16 or fp16 bias needs no conversion kernel before the product).
enum class VectorType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// What a fused epilogue reads at run time (kernel parameter).
struct FusionArgs {
  const void* bias;             // BiasActivation, Scaled: [N] of bias_type, or null
  VectorType bias_type;         // (Scaled: fp32)
  bool aux;                     // BiasActivation: add the residual; ActivationGrad, GatedGrad:
                                // always
  bool store_pre;               // BiasActivation: also store z; gated: the gate's and the up's
  const float* row_scale;       // Scaled: [M] fp32 (or one, row_scale_scalar), or null
  const float* col_scale;       // Scaled: [N] fp32 (or one, col_scale_scalar), or null
  bool row_scale_scalar;        // Scaled: one scale for every row (a per-tensor scale)
  bool col_scale_scalar;        // Scaled: one scale for every column
};

template <FusionKind kKind_, Activation kAct_ = Activation::kNone>
struct Fusion {
  static constexpr FusionKind kKind = kKind_;
  static constexpr Activation kAct = kAct_;
  // Reads an [M, N] operand in the staging buffer before writing it (residual, saved z).
  static constexpr bool kMayReadAux = kKind == FusionKind::kBiasActivation ||
                                      kKind == FusionKind::kActivationGrad ||
                                      kKind == FusionKind::kGatedGrad;
  static constexpr bool kGated = kKind == FusionKind::kGated;
  // Output columns per accumulator column.
  static constexpr int kOutPerAcc = kGated ? 2 : 1;
};

using PlainFusion = Fusion<FusionKind::kPlain>;

}  // namespace jax_tma
