// Host-visible contract of the fused dense products on the sm90 GEMM kernel (epilogue/fusion.h
// says what each fusion computes): the fusions, tiles and layouts compiled, and the launch entry
// point. Included by the FFI handler (ffi/dense.cc) and the kernels.
//
//   forward   D = act(A @ B + bias) (+ residual), optionally the pre-activation as a second
//             output; A [M, K] K-major, B [K, N] N-major (LayoutNN)
//   gradient  D = (A @ B) * act'(Z), A = dy [M, N'] K-major, B = w read as [N, K'] K-major
//             (LayoutNT): the cotangent of the pre-activation Z of a layer's input
//   gated     D = act(A @ Bg) * (A @ Bu), LayoutNN, two B maps over the same columns
//   gated gradient
//             D = (A @ B) * U * act'(G) and a second output (A @ B) * act(G), A = dy [M, N'],
//             B = w_down read as [N, K'] K-major (LayoutNT), G and U the gated product's saved
//             pre-activations: the gate's and the up's cotangents
// Inputs bf16 or fp16, outputs their type; rows of every operand 16-byte multiples.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "contract/sm90_gemm.h"
#include "epilogue/fusion.h"

namespace jax_tma::sm90_gemm {

using FuseNone = Fusion<FusionKind::kBiasActivation, Activation::kNone>;
using FuseRelu = Fusion<FusionKind::kBiasActivation, Activation::kRelu>;
using FuseGeluTanh = Fusion<FusionKind::kBiasActivation, Activation::kGeluTanh>;
using FuseGeluErf = Fusion<FusionKind::kBiasActivation, Activation::kGeluErf>;
using FuseSilu = Fusion<FusionKind::kBiasActivation, Activation::kSilu>;
using GradRelu = Fusion<FusionKind::kActivationGrad, Activation::kRelu>;
using GradGeluTanh = Fusion<FusionKind::kActivationGrad, Activation::kGeluTanh>;
using GradGeluErf = Fusion<FusionKind::kActivationGrad, Activation::kGeluErf>;
using GradSilu = Fusion<FusionKind::kActivationGrad, Activation::kSilu>;
using GatedSilu = Fusion<FusionKind::kGated, Activation::kSilu>;
using GatedGeluTanh = Fusion<FusionKind::kGated, Activation::kGeluTanh>;
using GatedGeluErf = Fusion<FusionKind::kGated, Activation::kGeluErf>;
using GatedGradSilu = Fusion<FusionKind::kGatedGrad, Activation::kSilu>;
using GatedGradGeluTanh = Fusion<FusionKind::kGatedGrad, Activation::kGeluTanh>;

// The tiles compiled with fused epilogues and the lists of kernels, JAX_TMA_SM90_DENSE_KERNELS(X)
// (X(tile, layout, fusion) for every compiled triple) and its forward, gradient and gated parts
// (one instantiation file each per type), are in contract/sm90_tiles.generated.h (the tile
// registry, jax_tma/_core/tiles.py): forward and gated fusions read B N-major (LayoutNN), the
// gradients K-major (LayoutNT); the forward gelu with erf on the narrow tiles only, the gated
// gradient on the ring tiles only.

// The fused epilogue's operands: the up weights' map (gated), the [M, N] operands' maps
// (residual or saved pre-activation; gated gradient: the gate's and the up's) and the second
// outputs' maps (pre-activations; gated gradient: the up's cotangent), each with D's box; null
// where the fusion does not use it.
struct FusedLaunch {
  const CUtensorMap* b2;
  const CUtensorMap* aux;
  const CUtensorMap* aux2;  // gated gradient: the up pre-activations (aux: the gate's)
  const CUtensorMap* pre;   // gated gradient: the up's cotangent
  const CUtensorMap* pre2;  // gated: the up pre-activations (pre: the gate's)
  FusionArgs args;
};

// Defined in sm90_dense_<in>_<group>.cu for every (Tile, Layout, Fusion) of
// JAX_TMA_SM90_DENSE_KERNELS, output type = input type. `args.shape.n` counts accumulator
// columns (gated: twice D's).
template <class In, class Tile, class Layout, class Fusion>
cudaError_t launch_fused(const LaunchArgs& args, const FusedLaunch& fused);

}  // namespace jax_tma::sm90_gemm
