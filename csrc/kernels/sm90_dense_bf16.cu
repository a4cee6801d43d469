// Instantiations of the fused dense products for bf16 inputs and output: every tile in every
// (layout, fusion) pair of JAX_TMA_SM90_DENSE_KERNELS.
#include "kernels/sm90_dense.cuh"

namespace jax_tma::sm90_gemm {

#define JAX_TMA_INSTANTIATE(TILE, LAYOUT, FUSION) \
  template cudaError_t launch_fused<__nv_bfloat16, TILE, LAYOUT, FUSION>(const LaunchArgs&, \
                                                                       const FusedLaunch&);

JAX_TMA_SM90_DENSE_KERNELS(JAX_TMA_INSTANTIATE)

#undef JAX_TMA_INSTANTIATE

}  // namespace jax_tma::sm90_gemm
