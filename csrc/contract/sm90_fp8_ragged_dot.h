// Host-visible contract of the block-scaled FP8 grouped (ragged) products on the sm90 GEMM kernel:
// the ragged rows mode (contract/sm90_ragged_dot.h) with the FP8 mainloop and scales
// (contract/sm90_fp8.h). Included by the FFI handler (ffi/ragged_dot.cc) and the kernels.
//
// Group sizes G per batch entry (int32, on the device), rows M per batch entry sorted by group:
//   out[b, r, n] = (sum over K slices s of 128:
//                     sa[s, b M + r] * sb[w, s, n / 128] * sum_{k in s} x[b, r, k] w_g[n, k])
//                  * row_scale * col_scale
// for row r of group g (w = g, or b G + g with batched weights); rows past the last group are
// zero. x [batch, M, K] and the weights [G or batch x G, N, K] K-major e4m3 (what FP8 wgmma
// reads); sa [ceil(K / 128), sa_ld >= batch x M] fp32, the stacked rows' (1 x 128) block scales
// (quantize_fp8's layout); sb [G or batch x G, ceil(K / 128), sb_ld >= ceil(N / 128)] fp32, each
// weight's (128 x 128) block scales; either optional (1 where absent); row_scale and col_scale
// one fp32 value each, optional (per-tensor scales, in the epilogue). out bf16 or fp32.
// K a multiple of 16, N of 8 (bf16 out) or 4 (fp32 out), sa_ld and sb_ld of 4 (16-byte rows).
//
// A's scales are read through one map over the stacked rows: a tile at a segment's first row plus
// its own loads its rows' scales at those absolute rows (rows past the segment belong to the next
// one, and are clipped at D's per-segment store like their products), in a box of
// Tile::kAScaleBoxAnyRow from the 4-aligned row at or before the tile's first (a group starts at
// any row; TMA's innermost coordinate must fall on 16 bytes); B's map has the weight as its batch
// coordinate, as B's own map does.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "contract/sm90_fp8.h"
#include "contract/sm90_gemm.h"
#include "contract/sm90_ragged_dot.h"

namespace jax_tma::sm90_gemm {

// The tiles compiled (JAX_TMA_SM90_FP8_RAGGED_TILES(X, ARG)) are in contract/sm90_tiles.generated.h
// (the tile registry, jax_tma/_core/tiles.py).

// Defined in sm90_fp8_ragged_dot_<type>.cu for every tile of JAX_TMA_SM90_FP8_RAGGED_TILES and
// both output types. `args` as launch_ragged's rows mode (A's, B's and D's template maps; the
// stacked rows' shape); `ragged` with one map per segment (D's); `fp8` the scales (row_scale and
// col_scale scalars or null, no bias).
template <class T, class Out, class Tile>
cudaError_t launch_fp8_ragged(const LaunchArgs& args, const RaggedArgs& ragged,
                              const Fp8Launch& fp8);

}  // namespace jax_tma::sm90_gemm
