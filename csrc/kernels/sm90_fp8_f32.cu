// Instantiations of the FP8 products with fp32 output (also split-K's partial products): every
// (tile, FP8 type) pair of JAX_TMA_SM90_FP8_KERNELS, and the unpromoted tile.
#include "kernels/sm90_fp8.cuh"

namespace jax_tma::sm90_gemm {

#define JAX_TMA_INSTANTIATE(TILE, TYPE) \
  template cudaError_t launch_fp8<TYPE, float, TILE, true>(const LaunchArgs&, const Fp8Launch&);

JAX_TMA_SM90_FP8_KERNELS(JAX_TMA_INSTANTIATE)

#undef JAX_TMA_INSTANTIATE

template cudaError_t launch_fp8<__nv_fp8_e4m3, float, Fp8UnpromotedTile, false>(
    const LaunchArgs&, const Fp8Launch&);

}  // namespace jax_tma::sm90_gemm
