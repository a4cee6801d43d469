// Block quantisation to e4m3 in one pass (jax_tma.quantize_fp8's 128 x 128 blocks): each CTA
// reads one 128 x 128 block of x [batch, rows, cols] once and writes its scale (the block's
// largest magnitude over 448, 1 for a block of zeros or one holding a NaN), its e4m3 values in
// x's layout and, where asked, the same values transposed ([batch, cols, rows]: the K-major
// form the FP8 kernels read of a weight stored [K, N]). Bit for bit the XLA form's as XLA:CPU
// computes it (ops/fp8/quantize.py): the scale the block maximum times the fp32 reciprocal of
// 448 (XLA's form of its division by that constant), the values divided by it (IEEE fp32; XLA's
// GPU division is not correctly rounded), clamped to +-448 and rounded to nearest even.
// x may come in two parts side by side along cols (a gated expert's gate and up weights, the
// first part's columns a multiple of 128): the outputs are those of their concatenation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_tma::fp8_quantize {

inline constexpr int kBlock = 128;

enum class Input : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct QuantizeParams {
  const void* x;      // [batch, rows, cols0] of `input`
  const void* x2;     // [batch, rows, cols - cols0] of `input`, or nullptr (then cols0 = cols)
  uint8_t* values;    // [batch, rows, cols] e4m3
  uint8_t* values_t;  // [batch, cols, rows] e4m3, or nullptr
  float* scales;      // [batch, ceil(cols / 128), ceil(rows / 128)]
  int64_t batch, rows, cols, cols0;
  Input input;
};

// Launches one CTA per block (a grid of at most 65535 batch entries, each CTA looping over
// the rest) on `stream`.
cudaError_t launch_quantize_blocks(const QuantizeParams& p, cudaStream_t stream);

}  // namespace jax_tma::fp8_quantize
