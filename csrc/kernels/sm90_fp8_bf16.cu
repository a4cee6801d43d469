// Instantiations of the FP8 products with bf16 output: every (tile, FP8 type) pair of
// JAX_TMA_SM90_FP8_KERNELS.
#include "kernels/sm90_fp8.cuh"

namespace jax_tma::sm90_gemm {

#define JAX_TMA_INSTANTIATE(TILE, TYPE) \
  template cudaError_t launch_fp8<TYPE, __nv_bfloat16, TILE, true>(const LaunchArgs&, \
                                                                  const Fp8Launch&);

JAX_TMA_SM90_FP8_KERNELS(JAX_TMA_INSTANTIATE)

#undef JAX_TMA_INSTANTIATE

}  // namespace jax_tma::sm90_gemm
