// Grouped (ragged) products on the sm90 GEMM kernel (contract: contract/sm90_ragged_dot.h).
// Two launches on the caller's stream, no host synchronisation (CUDA-graph safe):
//
// 1. The prepare kernel (kernels/sm90_ragged_prepare.cu, one CTA) reads the group sizes on the
//    device and writes the workspace: the segment table (scheduler/ragged_scheduler.cuh: each
//    segment's first row, row count, weight and, in rows mode, first row block, from prefix sums
//    over the groups) and one to three tensor maps per segment, copies of host-encoded templates
//    whose global address is moved to the segment's first row and whose row extent is cut to its
//    rows (tensormap.replace, then a release fence to the tensormap proxy).
// 2. sm90_gemm_kernel with RaggedRowsGemm or RaggedKGemm (kernels/sm90_gemm_problems.cuh), or
//    (launch_ragged_gated) RaggedGatedRowsGemm with a gated fusion: the gate and up weights'
//    blocks alternate in one mainloop, act(gate) * up is stored once, and the pre-activations,
//    when asked for, through two more maps per segment; or (launch_ragged_gated_grad)
//    RaggedGatedGradRowsGemm with a gated gradient fusion: dh = dy @ w_down^T per group, which
//    the epilogue warps turn into the gate's and the up's cotangents with the saved
//    pre-activations, read and written through three more maps per segment.
//
// Why per-segment maps: TMA bounds every copy by its map's extent, so a map that ends where a
// segment ends makes the hardware clip a tile's stores at the segment's last row (rows mode) and
// zero-fill a K slice past it (contraction mode), with no masking in the kernel and no tile
// running once per group it straddles: tiles start at their segment's first row and never
// straddle. The cost is one small kernel (~2 us) and an acquire fence per map and thread.
// (The segment table, maps and row blocks come from prepare_ragged, shared by every form.)
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/sm90_gemm_launch.cuh"
#include "contract/sm90_ragged_dot.h"
#include "kernels/sm90_ragged_prepare.cuh"

namespace jax_tma::sm90_gemm {

// Workspace of a call with `maps_per_segment` maps per segment: the maps, then the segment table.
struct RaggedWorkspace {
  CUtensorMap* maps;
  RaggedSegment* table;
};

// Launches the prepare kernel for `Tile`'s row blocks: the segment table and
// `maps_per_segment` maps per segment, from ragged.templates[0 .. maps_per_segment - 1].
template <class Tile>
cudaError_t prepare_ragged(const RaggedArgs& ragged, bool rows_mode, int maps_per_segment,
                           cudaStream_t stream, RaggedWorkspace* out) {
  const int64_t segments = ragged_segments(
      rows_mode ? RaggedMode::kRows : RaggedMode::kContraction, ragged.groups, ragged.batch);
  auto* base = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(ragged.workspace) + kRaggedAlign - 1) &
      ~uintptr_t{kRaggedAlign - 1});
  out->maps = reinterpret_cast<CUtensorMap*>(base);
  out->table = reinterpret_cast<RaggedSegment*>(
      base + segments * maps_per_segment * kRaggedMapBytes);

  RaggedPrepareParams prepare{};
  prepare.group_sizes = ragged.group_sizes;
  prepare.group_sizes_batch_stride = ragged.group_sizes_batched ? ragged.groups : 0;
  prepare.groups = ragged.groups;
  prepare.batch = ragged.batch;
  prepare.rows = ragged.rows;
  prepare.tail = rows_mode;
  prepare.weights_batched = ragged.weights_batched;
  prepare.block_m = Tile::kBlockM;
  prepare.cluster_m = Tile::kClusterM;
  prepare.segments = out->table;
  prepare.maps = out->maps;
  prepare.maps_per_segment = maps_per_segment;
  RaggedTemplates templates{};
  for (int i = 0; i < maps_per_segment; ++i) {
    templates.maps[i] = *ragged.templates[i];
    prepare.bases[i] = static_cast<const uint8_t*>(ragged.bases[i]);
    prepare.row_bytes[i] = ragged.row_bytes[i];
  }
  return launch_ragged_prepare(templates, prepare, stream);
}

template <class In, class Out, class Tile, class Layout, RaggedMode kMode>
cudaError_t launch_ragged(const LaunchArgs& args, const RaggedArgs& ragged) {
  constexpr bool kRows = kMode == RaggedMode::kRows;
  const int segments = static_cast<int>(ragged_segments(kMode, ragged.groups, ragged.batch));
  RaggedWorkspace ws{};
  cudaError_t err =
      prepare_ragged<Tile>(ragged, kRows, ragged_maps_per_segment(kMode), args.stream, &ws);
  if (err != cudaSuccess) return err;

  if constexpr (kRows) {
    Launcher<In, Out, Tile, Layout, RaggedRowsGemm> launcher;
    using K = typename decltype(launcher)::K;
    err = launcher.init(args.num_sms, args.stream);
    if (err != cudaSuccess) return err;
    const typename K::Problem::Params params{
        K::Scheduler::make_params(ws.table, segments, args.shape.n, args.shape.k), ws.maps};
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
        K::Scheduler::make_params(ws.table, segments, args.shape.m, args.shape.n), ws.maps};
    const int units = params.tiles.tiles.num_units;
    return launcher.launch(std::max(1, std::min(units, launcher.resident())), args, params,
                           typename K::Partials{nullptr, nullptr});
  }
}

// The gated rows mode: the rows mode's schedule with the gated fusion's epilogue, and three maps
// per segment, D's and the pre-activations' (RaggedGatedRowsGemm's stride; without store_pre the
// last two are copies of D's template, never used).
template <class In, class Tile, class Layout, class Fusion>
cudaError_t launch_ragged_gated(const LaunchArgs& args, const RaggedArgs& ragged,
                                const CUtensorMap& up, bool store_pre) {
  static_assert(Fusion::kGated);
  const int segments =
      static_cast<int>(ragged_segments(RaggedMode::kRows, ragged.groups, ragged.batch));
  RaggedWorkspace ws{};
  cudaError_t err =
      prepare_ragged<Tile>(ragged, true, kRaggedGatedMapsPerSegment, args.stream, &ws);
  if (err != cudaSuccess) return err;
  Launcher<In, In, Tile, Layout, RaggedGatedRowsGemm, Fusion> launcher;
  using K = typename decltype(launcher)::K;
  err = launcher.init(args.num_sms, args.stream);
  if (err != cudaSuccess) return err;
  const typename K::Problem::Params params{
      K::Scheduler::make_params(ws.table, segments, args.shape.n, args.shape.k), ws.maps};
  FusedParams fused{};
  fused.b2 = up;
  fused.args.store_pre = store_pre;
  return launcher.launch(launcher.resident(), args, params,
                         typename K::Partials{nullptr, nullptr}, fused);
}

// The gated gradient rows mode: the rows mode's schedule with the gated gradient's epilogue
// (finished by the epilogue warps, which read the pre-activations through their ring), and
// four maps per segment (RaggedGatedGradRowsGemm's stride). Its fused parameters' maps are
// unused: the warps use the segment's.
template <class In, class Tile, class Layout, class Fusion>
cudaError_t launch_ragged_gated_grad(const LaunchArgs& args, const RaggedArgs& ragged) {
  static_assert(Fusion::kKind == FusionKind::kGatedGrad);
  const int segments =
      static_cast<int>(ragged_segments(RaggedMode::kRows, ragged.groups, ragged.batch));
  RaggedWorkspace ws{};
  cudaError_t err =
      prepare_ragged<Tile>(ragged, true, kRaggedGatedGradMapsPerSegment, args.stream, &ws);
  if (err != cudaSuccess) return err;
  Launcher<In, In, Tile, Layout, RaggedGatedGradRowsGemm, Fusion> launcher;
  using K = typename decltype(launcher)::K;
  static_assert(K::kAuxRing, "the gated gradient needs the epilogue warps' ring");
  err = launcher.init(args.num_sms, args.stream);
  if (err != cudaSuccess) return err;
  const typename K::Problem::Params params{
      K::Scheduler::make_params(ws.table, segments, args.shape.n, args.shape.k), ws.maps};
  FusedParams fused{};
  fused.args.aux = true;
  return launcher.launch(launcher.resident(), args, params,
                         typename K::Partials{nullptr, nullptr}, fused);
}

}  // namespace jax_tma::sm90_gemm
