// Host-visible contract of the FP8 products on the sm90 GEMM kernel (kernels/sm90_gemm.cuh with
// the FP8 mainloop, mainloop/sm90_tma_wgmma_fp8.cuh): the tiles compiled, the scale layouts and
// the launch entry point. Included by the FFI handler (ffi/fp8.cc) and the kernels.
//
//   D[b, m, n] = (sum over K slices s of 128:
//                   sa[b, s, m] * sb[b, s, n / 128] * sum_{k in s} A[b, m, k] B[b, n, k])
//                * row_scale[m] * col_scale[n] + bias[n]
// A [batch, M, K] and B [batch, N, K]: K-major FP8, both e4m3 or both e5m2 (a batch of 1 for an
// operand shared by every entry); the block scales sa [batch, ceil(K / 128), M] and
// sb [batch, ceil(K / 128), ceil(N / 128)] fp32, their rows padded to 16-byte multiples, each
// optional (1 where absent); row_scale [M] (or one value), col_scale [N] (or one value), bias [N]
// fp32, each optional. D bf16 or fp32, [splits, batch,
// M, N] (split-K: fp32 partial products, one per K range). K a multiple of 16 and N of 8
// (16-byte rows of the operands and of D).
#pragma once

#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "epilogue/fusion.h"
#include "kernels/sm90_gemm.h"

namespace jax_tma::sm90_gemm {

template <int kBlockM, int kBlockN, int kStages, int kClusterM,
          int kEpilogueBuffers = (kBlockN + 63) / 64>
using Fp8Tile =
    TileConfig<kBlockM, kBlockN, kStages, kClusterM, EpilogueKind::kTmaStore, kEpilogueBuffers, 1>;

// The tiles compiled; jax_tma/fp8.py mirrors the list (_FP8_TILES). Each stage holds a K slice
// of 128, twice the 16-bit kernel's, so a stage is worth two of those.
// NOTE: the stage counts are the most that fit 227 KB beside a whole block's output staging,
// except 64 x 256, which stages half a block at a time (a two-batch epilogue) to keep 4 stages
// of B in flight: decode-like products stream B. 128 x 256 tiles promote in two 128-column
// parts (64 registers of partial sums beside 128 promoted ones); 64-row tiles are ping-pong.
using Fp8Tile128x256C2 = Fp8Tile<128, 256, 3, 2>;
using Fp8Tile128x256 = Fp8Tile<128, 256, 3, 1>;
using Fp8Tile128x128C2 = Fp8Tile<128, 128, 5, 2>;
using Fp8Tile128x128 = Fp8Tile<128, 128, 5, 1>;
using Fp8Tile64x256 = Fp8Tile<64, 256, 4, 1, 2>;
using Fp8Tile64x128 = Fp8Tile<64, 128, 7, 1>;

#define JAX_TMA_SM90_FP8_TILES(X, ARG) \
  X(ARG, Fp8Tile128x256C2)             \
  X(ARG, Fp8Tile128x256)               \
  X(ARG, Fp8Tile128x128C2)             \
  X(ARG, Fp8Tile128x128)               \
  X(ARG, Fp8Tile64x256)                \
  X(ARG, Fp8Tile64x128)
#define JAX_TMA_SM90_FP8_TYPES(X, TILE) \
  X(TILE, __nv_fp8_e4m3)                \
  X(TILE, __nv_fp8_e5m2)
// X(tile, FP8 type) for every compiled (tile, operand type) pair.
#define JAX_TMA_SM90_FP8_KERNELS(X) JAX_TMA_SM90_FP8_TILES(JAX_TMA_SM90_FP8_TYPES, X)
// The one tile compiled without promotion (kPromote = false: the whole K range accumulated in
// the tensor core; per-tensor scales only), e4m3 with fp32 output: what the tests measure the
// promotion's gain against.
using Fp8UnpromotedTile = Fp8Tile128x128;

// The FP8 products' epilogue: row and column scales and a bias (epilogue/fusion.h).
using FuseScaled = Fusion<FusionKind::kScaled>;

// The scales of one call: the block scales' tensor maps (mainloop/sm90_tma_wgmma_fp8.cuh,
// MainloopSm90Fp8::Params; null where the operand has none) and the epilogue's vectors (null
// where absent; a scalar one holds one value for every row or column).
struct Fp8Launch {
  const CUtensorMap* scale_a;
  const CUtensorMap* scale_b;
  const float* row_scale;
  const float* col_scale;
  bool row_scale_scalar;
  bool col_scale_scalar;
  const float* bias;
};

// Defined in sm90_fp8_<out>.cu for every (FP8 type, tile) of JAX_TMA_SM90_FP8_KERNELS (both
// operands of type T), and for the unpromoted tile.
template <class T, class Out, class Tile, bool kPromote = true>
cudaError_t launch_fp8(const LaunchArgs& args, const Fp8Launch& fp8);

}  // namespace jax_tma::sm90_gemm
