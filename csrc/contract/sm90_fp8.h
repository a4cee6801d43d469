// Host-visible contract of the FP8 products on the sm90 GEMM kernel (kernels/sm90_gemm_kernel.cuh
// with the FP8 mainloop, mainloop/sm90_tma_wgmma_fp8.cuh): the tiles compiled, the scale layouts
// and the launch entry point. Included by the FFI handler (ffi/fp8.cc) and the kernels.
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

#include "contract/sm90_gemm.h"
#include "epilogue/fusion.h"

namespace jax_tma::sm90_gemm {

// The FP8 tiles (Fp8Tile128x256C2, ...) are listed in contract/sm90_tiles.generated.h (the tile
// registry, jax_tma/_core/tiles.py): JAX_TMA_SM90_FP8_TILES(X, ARG), compiled with promotion,
// and JAX_TMA_SM90_FP8_FAST_TILES(X, ARG), compiled without (kPromote = false: the whole K
// range accumulated in the tensor core, per-tensor, row and column scales only), each for both
// FP8 types and both output types. Each stage holds
// a K slice of 128, twice the 16-bit kernel's, so a stage is worth two of those.

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

// Defined in sm90_fp8_<type>_<out>.cu for every tile of JAX_TMA_SM90_FP8_TILES (kPromote) and
// JAX_TMA_SM90_FP8_FAST_TILES (!kPromote), both operands of type T.
template <class T, class Out, class Tile, bool kPromote = true>
cudaError_t launch_fp8(const LaunchArgs& args, const Fp8Launch& fp8);

}  // namespace jax_tma::sm90_gemm
