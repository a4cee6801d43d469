// Instantiations of the sm90 GEMM for bf16 inputs and bf16 output: every compiled tile
// configuration in every operand layout (one file per type pair, so they compile in parallel).
#include "kernels/sm90_gemm.cuh"

namespace jax_tma::sm90_gemm {

#define JAX_TMA_INSTANTIATE(TILE, LAYOUT) \
  template cudaError_t launch<__nv_bfloat16, __nv_bfloat16, TILE, LAYOUT>(const LaunchArgs&);

JAX_TMA_SM90_GEMM_KERNELS(JAX_TMA_INSTANTIATE)

#undef JAX_TMA_INSTANTIATE

}  // namespace jax_tma::sm90_gemm
