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

#include "epilogue/fusion.h"
#include "kernels/sm90_gemm.h"

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

// Tiles compiled with fused epilogues; jax_tma/epilogues.py mirrors the lists (_DENSE_TILES).
// 64 x 256 ping-pong tiles, which hide one consumer's epilogue under the other's mainloop, ran
// every fused pattern 13-17 % slower than 128 x 256 on the large products (23-38 % in cluster
// pairs; bench_epilogues.py --sweep, H100, docs/ragged-and-epilogues.md): not compiled here.
// NOTE: the forward gelu with erf spills on 128 x 256 tiles (erff's registers on top of 128
// accumulators): it is compiled on the narrower tiles only.
#define JAX_TMA_SM90_DENSE_TILES(X, ARG) \
  X(ARG, Tile128x256C2)                  \
  X(ARG, Tile128x256)                    \
  X(ARG, Tile128x128)                    \
  X(ARG, Tile64x128)
#define JAX_TMA_SM90_DENSE_NARROW_TILES(X, ARG) \
  X(ARG, Tile128x128)                           \
  X(ARG, Tile64x128)
// The gated gradient is finished by the epilogue warps only, which read its two pre-activations
// through their ring: compiled on the tiles whose shared memory holds one. NOTE: not with the
// exact GELU, whose erff spilled 24-56 bytes a thread in the warps' 56 registers there.
#define JAX_TMA_SM90_DENSE_RING_TILES(X, ARG) \
  X(ARG, Tile128x256C2)                       \
  X(ARG, Tile128x256)
#define JAX_TMA_SM90_DENSE_FUSIONS(X, TILE) \
  X(TILE, LayoutNN, FuseNone)               \
  X(TILE, LayoutNN, FuseRelu)               \
  X(TILE, LayoutNN, FuseGeluTanh)           \
  X(TILE, LayoutNN, FuseSilu)               \
  X(TILE, LayoutNT, GradRelu)               \
  X(TILE, LayoutNT, GradGeluTanh)           \
  X(TILE, LayoutNT, GradGeluErf)            \
  X(TILE, LayoutNT, GradSilu)               \
  X(TILE, LayoutNN, GatedSilu)              \
  X(TILE, LayoutNN, GatedGeluTanh)          \
  X(TILE, LayoutNN, GatedGeluErf)
#define JAX_TMA_SM90_DENSE_NARROW_FUSIONS(X, TILE) X(TILE, LayoutNN, FuseGeluErf)
#define JAX_TMA_SM90_DENSE_RING_FUSIONS(X, TILE) \
  X(TILE, LayoutNT, GatedGradSilu)               \
  X(TILE, LayoutNT, GatedGradGeluTanh)
#define JAX_TMA_SM90_DENSE_KERNELS(X)                                    \
  JAX_TMA_SM90_DENSE_TILES(JAX_TMA_SM90_DENSE_FUSIONS, X)                 \
  JAX_TMA_SM90_DENSE_NARROW_TILES(JAX_TMA_SM90_DENSE_NARROW_FUSIONS, X)   \
  JAX_TMA_SM90_DENSE_RING_TILES(JAX_TMA_SM90_DENSE_RING_FUSIONS, X)

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

// Defined in sm90_dense_<in>.cu for every (Tile, Layout, Fusion) of JAX_TMA_SM90_DENSE_KERNELS,
// output type = input type. `args.shape.n` counts accumulator columns (gated: twice D's).
template <class In, class Tile, class Layout, class Fusion>
cudaError_t launch_fused(const LaunchArgs& args, const FusedLaunch& fused);

}  // namespace jax_tma::sm90_gemm
