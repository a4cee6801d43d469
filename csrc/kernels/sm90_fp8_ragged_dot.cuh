// Block-scaled FP8 grouped (ragged) products (contract: contract/sm90_fp8_ragged_dot.h): the
// ragged rows mode's two launches (kernels/sm90_ragged_dot.cuh: the prepare kernel writes the
// segment table and D's map per segment) with the FP8 mainloop (mainloop/sm90_tma_wgmma_fp8.cuh:
// K slices of 128, partial sums promoted with the block scales) and the scaled epilogue of the
// dense FP8 product (per-tensor scales). The problem is RaggedRowsGemm unchanged: its load plan's
// absolute row and weight coordinates are what the scales' maps take too, but a group (so a
// tile) may start at any row, and TMA's innermost coordinate must fall on 16 bytes: the
// mainloop's kAnyRow form loads A's scales from the 4-aligned row at or before the tile's first.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "contract/sm90_fp8_ragged_dot.h"
#include "kernels/sm90_fp8.cuh"
#include "kernels/sm90_ragged_dot.cuh"
#include "mainloop/sm90_tma_wgmma_fp8.cuh"

namespace jax_tma::sm90_gemm {

template <class T, class Out, class Tile>
cudaError_t launch_fp8_ragged(const LaunchArgs& args, const RaggedArgs& ragged,
                              const Fp8Launch& fp8) {
  constexpr RaggedMode kMode = RaggedMode::kRows;
  const int segments = static_cast<int>(ragged_segments(kMode, ragged.groups, ragged.batch));
  RaggedWorkspace ws{};
  cudaError_t err =
      prepare_ragged<Tile>(ragged, true, ragged_maps_per_segment(kMode), args.stream, &ws);
  if (err != cudaSuccess) return err;
  // Tiles start at a group's first row, anywhere: A's scales come from the 4-aligned row before.
  Launcher<T, Out, Tile, LayoutNT, RaggedRowsGemm, FuseScaled, Fp8Mainloop<T, true, true>>
      launcher;
  using K = typename decltype(launcher)::K;
  err = launcher.init(args.num_sms, args.stream);
  if (err != cudaSuccess) return err;
  const typename K::Problem::Params params{
      K::Scheduler::make_params(ws.table, segments, args.shape.n, args.shape.k), ws.maps};
  // Per-tensor scales only (a row vector would be indexed by the segment's rows): promoted, so
  // the mainloop applies them.
  FusedParams fused{};
  const auto scales = fp8_scales<typename K::Mainloop>(fp8, true, fused.args);
  // The work is known only on the device: every resident cluster starts (launch_ragged).
  return launcher.launch(launcher.resident(), args, params,
                         typename K::Partials{nullptr, nullptr}, fused, scales);
}

}  // namespace jax_tma::sm90_gemm
