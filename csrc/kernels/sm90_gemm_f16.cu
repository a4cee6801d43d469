// Instantiations of the sm90 GEMM for fp16 inputs (one file per input type, so they compile
// in parallel).
#include "kernels/sm90_gemm.cuh"

namespace jax_tma::sm90_gemm {

#define JAX_TMA_INSTANTIATE(OUT, TILE) \
  template cudaError_t launch<__half, OUT, TILE>(const LaunchArgs&);

JAX_TMA_INSTANTIATE(__nv_bfloat16, Tile128x128)
JAX_TMA_INSTANTIATE(__nv_bfloat16, Tile128x256)
JAX_TMA_INSTANTIATE(__half, Tile128x128)
JAX_TMA_INSTANTIATE(__half, Tile128x256)
JAX_TMA_INSTANTIATE(float, Tile128x128)
JAX_TMA_INSTANTIATE(float, Tile128x256)

#undef JAX_TMA_INSTANTIATE

}  // namespace jax_tma::sm90_gemm
