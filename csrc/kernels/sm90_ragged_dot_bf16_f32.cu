// Instantiations of the grouped (ragged) products for bf16 inputs and f32 output: every tile
// configuration in every (layout, mode) pair of JAX_TMA_SM90_RAGGED_KERNELS.
#include "kernels/sm90_ragged_dot.cuh"

namespace jax_tma::sm90_gemm {

#define JAX_TMA_INSTANTIATE(TILE, LAYOUT, MODE)                                       \
  template cudaError_t launch_ragged<__nv_bfloat16, float, TILE, LAYOUT, MODE>(const LaunchArgs&, \
                                                                    const RaggedArgs&);

JAX_TMA_SM90_RAGGED_KERNELS(JAX_TMA_INSTANTIATE)

#undef JAX_TMA_INSTANTIATE

}  // namespace jax_tma::sm90_gemm
