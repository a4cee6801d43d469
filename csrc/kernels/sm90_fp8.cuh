// FP8 products on the sm90 GEMM kernel (contract: contract/sm90_fp8.h): the dense problem
// (DenseGemm) with the FP8 mainloop and the scaled epilogue.
#pragma once

#include "contract/sm90_fp8.h"
#include "kernels/sm90_gemm_launch.cuh"
#include "mainloop/sm90_tma_wgmma_fp8.cuh"

namespace jax_tma::sm90_gemm {

template <class T, class Out, class Tile, bool kPromote>
cudaError_t launch_fp8(const LaunchArgs& args, const Fp8Launch& fp8) {
  using Mainloop = Fp8Mainloop<T, kPromote>;
  using K = Kernel<T, Out, Tile, LayoutNT, DenseGemm, FuseScaled, Mainloop>;
  FusedParams fused{};
  fused.args.bias = fp8.bias;
  fused.args.bias_type = VectorType::kF32;
  fused.args.row_scale = fp8.row_scale;
  fused.args.col_scale = fp8.col_scale;
  fused.args.row_scale_scalar = fp8.row_scale_scalar;
  fused.args.col_scale_scalar = fp8.col_scale_scalar;
  typename K::Mainloop::Params scales{};
  if (fp8.scale_a != nullptr) scales.sa = *fp8.scale_a;
  if (fp8.scale_b != nullptr) scales.sb = *fp8.scale_b;
  scales.has_sa = fp8.scale_a != nullptr;
  scales.has_sb = fp8.scale_b != nullptr;
  return launch_dense<T, Out, Tile, LayoutNT, FuseScaled, Mainloop>(args, fused, scales);
}

}  // namespace jax_tma::sm90_gemm
