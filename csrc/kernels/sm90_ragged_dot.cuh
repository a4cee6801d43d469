// Grouped (ragged) products on the sm90 GEMM kernel (contract: contract/sm90_ragged_dot.h).
// Two launches on the caller's stream, no host synchronisation (CUDA-graph safe):
//
// 1. The prepare kernel (kernels/sm90_ragged_prepare.cu, one CTA) reads the group sizes on the
//    device and writes the workspace: the segment table (scheduler/ragged_scheduler.cuh: each
//    segment's first row, row count, weight and, in rows mode, first row block, from prefix sums
//    over the groups) and one or two tensor maps per segment, copies of host-encoded templates
//    whose global address is moved to the segment's first row and whose row extent is cut to its
//    rows (tensormap.replace, then a release fence to the tensormap proxy).
// 2. sm90_gemm_kernel with RaggedRowsGemm or RaggedKGemm (kernels/sm90_gemm_problems.cuh).
//
// Why per-segment maps: TMA bounds every copy by its map's extent, so a map that ends where a
// segment ends makes the hardware clip a tile's stores at the segment's last row (rows mode) and
// zero-fill a K slice past it (contraction mode), with no masking in the kernel and no tile
// running once per group it straddles: tiles start at their segment's first row and never
// straddle. The cost is one small kernel (~2 us) and an acquire fence per map and thread.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/sm90_gemm_launch.cuh"
#include "contract/sm90_ragged_dot.h"
#include "kernels/sm90_ragged_prepare.cuh"

namespace jax_tma::sm90_gemm {

template <class In, class Out, class Tile, class Layout, RaggedMode kMode>
cudaError_t launch_ragged(const LaunchArgs& args, const RaggedArgs& ragged) {
  constexpr bool kRows = kMode == RaggedMode::kRows;
  const int64_t segments = ragged_segments(kMode, ragged.groups, ragged.batch);
  auto* base = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(ragged.workspace) + kRaggedAlign - 1) &
      ~uintptr_t{kRaggedAlign - 1});
  auto* maps = reinterpret_cast<CUtensorMap*>(base);
  auto* table = reinterpret_cast<RaggedSegment*>(
      base + segments * ragged_maps_per_segment(kMode) * kRaggedMapBytes);

  RaggedPrepareParams prepare{};
  prepare.group_sizes = ragged.group_sizes;
  prepare.group_sizes_batch_stride = ragged.group_sizes_batched ? ragged.groups : 0;
  prepare.groups = ragged.groups;
  prepare.batch = ragged.batch;
  prepare.rows = ragged.rows;
  prepare.tail = kRows;
  prepare.weights_batched = ragged.weights_batched;
  prepare.block_m = Tile::kBlockM;
  prepare.cluster_m = Tile::kClusterM;
  prepare.segments = table;
  prepare.maps = maps;
  prepare.maps_per_segment = ragged_maps_per_segment(kMode);
  for (int i = 0; i < 2; ++i) {
    prepare.bases[i] = static_cast<const uint8_t*>(ragged.bases[i]);
    prepare.row_bytes[i] = ragged.row_bytes[i];
  }
  cudaError_t err = launch_ragged_prepare(
      *ragged.templates[0], *(kRows ? ragged.templates[0] : ragged.templates[1]), prepare,
      args.stream);
  if (err != cudaSuccess) return err;

  if constexpr (kRows) {
    Launcher<In, Out, Tile, Layout, RaggedRowsGemm> launcher;
    using K = typename decltype(launcher)::K;
    err = launcher.init(args.num_sms, args.stream);
    if (err != cudaSuccess) return err;
    const typename K::Problem::Params params{
        K::Scheduler::make_params(table, static_cast<int>(segments), args.shape.n,
                                  args.shape.k),
        maps};
    // The work is known only on the device: every resident cluster starts, and those left
    // without units return at once.
    return launcher.launch(launcher.resident(), args, params,
                           typename K::Partials{nullptr, nullptr});
  } else {
    Launcher<In, Out, Tile, Layout, RaggedKGemm> launcher;
    using K = typename decltype(launcher)::K;
    err = launcher.init(args.num_sms, args.stream);
    if (err != cudaSuccess) return err;
    const typename K::Problem::Params params{
        K::Scheduler::make_params(table, static_cast<int>(segments), args.shape.m,
                                  args.shape.n),
        maps};
    const int units = params.tiles.tiles.num_units;
    return launcher.launch(std::max(1, std::min(units, launcher.resident())), args, params,
                           typename K::Partials{nullptr, nullptr});
  }
}

}  // namespace jax_tma::sm90_gemm
