// FP8 products on the sm90 GEMM kernel (contract: contract/sm90_fp8.h): the dense problem
// (DenseGemm) with the FP8 mainloop and the scaled epilogue.
#pragma once

#include "contract/sm90_fp8.h"
#include "kernels/sm90_gemm_launch.cuh"
#include "mainloop/sm90_tma_wgmma_fp8.cuh"

namespace jax_tma::sm90_gemm {

// The launch's scales split between the FP8 mainloop (`Mainloop`: MainloopSm90Fp8) and the
// scaled epilogue (`args`): block scales to the mainloop; a per-tensor scale of an operand
// without block scales to the mainloop too where it promotes (it multiplies every slice's partial
// sums anyway); other scales (per-row or per-column, or without promotion) and the bias to the
// epilogue.
template <class Mainloop>
typename Mainloop::Params fp8_scales(const Fp8Launch& fp8, bool promote, FusionArgs& args) {
  typename Mainloop::Params scales{};
  if (fp8.scale_a != nullptr) scales.sa = *fp8.scale_a;
  if (fp8.scale_b != nullptr) scales.sb = *fp8.scale_b;
  scales.has_sa = fp8.scale_a != nullptr;
  scales.has_sb = fp8.scale_b != nullptr;
  const bool fold_a = promote && !scales.has_sa && fp8.row_scale != nullptr && fp8.row_scale_scalar;
  const bool fold_b = promote && !scales.has_sb && fp8.col_scale != nullptr && fp8.col_scale_scalar;
  scales.tensor_sa = fold_a ? fp8.row_scale : nullptr;
  scales.tensor_sb = fold_b ? fp8.col_scale : nullptr;
  args.bias = fp8.bias;
  args.bias_type = VectorType::kF32;
  args.row_scale = fold_a ? nullptr : fp8.row_scale;
  args.col_scale = fold_b ? nullptr : fp8.col_scale;
  args.row_scale_scalar = fp8.row_scale_scalar;
  args.col_scale_scalar = fp8.col_scale_scalar;
  return scales;
}

template <class T, class Out, class Tile, bool kPromote>
cudaError_t launch_fp8(const LaunchArgs& args, const Fp8Launch& fp8) {
  using Mainloop = Fp8Mainloop<T, kPromote>;
  using K = Kernel<T, Out, Tile, LayoutNT, DenseGemm, FuseScaled, Mainloop>;
  FusedParams fused{};
  const auto scales = fp8_scales<typename K::Mainloop>(fp8, kPromote, fused.args);
  return launch_dense<T, Out, Tile, LayoutNT, FuseScaled, Mainloop>(args, fused, scales);
}

}  // namespace jax_tma::sm90_gemm
