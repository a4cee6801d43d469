// Fused dense products on the sm90 GEMM kernel (contract: contract/sm90_dense.h): the dense
// problem (DenseGemm) with a fused epilogue (epilogue/fusion.h) in place of the plain store.
#pragma once

#include "contract/sm90_dense.h"
#include "kernels/sm90_gemm_launch.cuh"

namespace jax_tma::sm90_gemm {

template <class In, class Tile, class Layout, class Fusion>
cudaError_t launch_fused(const LaunchArgs& args, const FusedLaunch& fused) {
  FusedParams params{};
  if (fused.b2 != nullptr) params.b2 = *fused.b2;
  if (fused.aux != nullptr) params.aux = *fused.aux;
  if (fused.aux2 != nullptr) params.aux2 = *fused.aux2;
  if (fused.pre != nullptr) params.pre = *fused.pre;
  if (fused.pre2 != nullptr) params.pre2 = *fused.pre2;
  params.args = fused.args;
  return launch_dense<In, In, Tile, Layout, Fusion>(args, params);
}

}  // namespace jax_tma::sm90_gemm
