// Epilogue that writes a warpgroup's wgmma accumulators straight from registers to global
// memory, converted to the output type and clipped to the matrix bounds. Works for any M, N
// and row stride; pairs of columns go out as one 4- or 8-byte store when the matrix's base
// and row stride keep them aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jax_tma {

template <class Out>
struct OutputPair;

template <>
struct OutputPair<float> {
  using Type = float2;
  __device__ static Type make(float x, float y) { return make_float2(x, y); }
  __device__ static float one(float x) { return x; }
};
template <>
struct OutputPair<__nv_bfloat16> {
  using Type = __nv_bfloat162;
  __device__ static Type make(float x, float y) { return __floats2bfloat162_rn(x, y); }
  __device__ static __nv_bfloat16 one(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct OutputPair<__half> {
  using Type = __half2;
  __device__ static Type make(float x, float y) { return __floats2half2_rn(x, y); }
  __device__ static __half one(float x) { return __float2half_rn(x); }
};

// Stores the 64 x kBlockN accumulator block of one warpgroup whose first row is `row0` and
// first column `col0` into the m x n matrix at `d` with row stride `ldd` (accumulator layout:
// ptx/wgmma.cuh).
template <class Out, int kBlockN>
struct DirectStoreEpilogue {
  using Pair = typename OutputPair<Out>::Type;

  __device__ static void store(const float (&acc)[kBlockN / 2], Out* __restrict__ d, int m,
                               int n, int64_t ldd, int row0, int col0) {
    const int lane = threadIdx.x % 32;
    const int warp = (threadIdx.x / 32) % 4;
    const int row_base = row0 + 16 * warp + lane / 4;
    const int col_base = col0 + 2 * (lane % 4);
    // A pair at an even column stays aligned when the matrix starts pair-aligned (a batch or
    // split offset may be odd) and every row starts at an even element.
    const bool paired =
        (ldd % 2) == 0 && reinterpret_cast<uintptr_t>(d) % alignof(Pair) == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + 8 * h;
      if (row >= m) continue;
      Out* d_row = d + static_cast<int64_t>(row) * ldd;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const int col = col_base + 8 * j;
        const float x = acc[4 * j + 2 * h];
        const float y = acc[4 * j + 2 * h + 1];
        if (paired && col + 1 < n) {
          *reinterpret_cast<Pair*>(d_row + col) = OutputPair<Out>::make(x, y);
        } else {
          if (col < n) d_row[col] = OutputPair<Out>::one(x);
          if (col + 1 < n) d_row[col + 1] = OutputPair<Out>::one(y);
        }
      }
    }
  }
};

}  // namespace jax_tma
