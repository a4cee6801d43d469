// Host-visible contract of the grouped (ragged) products on the sm90 GEMM kernel: their two
// modes, the segment table and per-segment tensor maps in the workspace, the tile
// configurations and layouts compiled for them, and the launch entry point. Included by the
// FFI handler (ffi/ragged_dot.cc) and the kernels, so both read every size from here.
//
// Group sizes G per batch entry (int32, on the device), rows M per batch entry, sorted by group:
//   rows mode (ragged_dot):        out[b, rows of g] = lhs[b, rows of g] @ rhs[b or -, g]
//                                  lhs [batch, M, K], rhs [G, K, N] (N-major, LayoutNN) or
//                                  [G, N, K] (K-major, LayoutNT), out [batch, M, N]; rows past
//                                  the last group are zero.
//   contraction mode (the weight gradient):
//                                  out[b, g] = lhs[b, rows of g]^T @ dy[b, rows of g]
//                                  lhs [batch, M, K] (the product's A, M-major: LayoutTN),
//                                  dy [batch, M, N], out [batch, G, K, N]; zero for an empty group.
//   gated rows mode (gated_ragged_dot):
//                                  out[b, rows of g] = act(lhs[b, rows of g] @ gate[b or -, g]) *
//                                  (lhs[b, rows of g] @ up[b or -, g]), gate and up [G, K, F]
//                                  N-major (LayoutNN), out [batch, M, F]; optionally the two
//                                  pre-activations as second outputs pre [2, batch, M, F], clipped
//                                  per segment like out. Rows past the last group are zero.
//   gated gradient rows mode (gated_ragged_mlp's backward):
//                                  dh = dy[b, rows of g] @ w_down[b or -, g]^T, w_down [G, F, D]
//                                  read K-major (LayoutNT), dy [batch, M, D]; from the saved
//                                  pre-activations gate and up [batch, M, F] of the same rows,
//                                  out (the gate's cotangent) = dh * up * act'(gate) and d_up
//                                  = dh * act(gate), both [batch, M, F]; rows past the last
//                                  group are zero in both.
// Group g's rows start after groups 0..g-1's; sizes are clamped to [0, M] and the running sum
// to M (a sum past M cuts the last groups short).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "contract/sm90_dense.h"
#include "contract/sm90_gemm.h"

namespace jax_tma::sm90_gemm {

enum class RaggedMode : int { kRows = 0, kContraction = 1 };

// Row segments per call (scheduler/ragged_scheduler.cuh): every group of every batch entry,
// and in rows mode one more per entry for the rows after its last group.
inline constexpr int64_t ragged_segments(RaggedMode mode, int64_t groups, int64_t batch) {
  return batch * (groups + (mode == RaggedMode::kRows ? 1 : 0));
}
// Tensor maps the prepare kernel writes per segment: D's (rows mode), A's and B's (contraction).
inline constexpr int ragged_maps_per_segment(RaggedMode mode) {
  return mode == RaggedMode::kRows ? 1 : 2;
}
// The gated rows mode's: D's, then the gate's and the up's pre-activations (the epilogue finds
// a segment's second outputs in the maps after its D's).
inline constexpr int kRaggedGatedMapsPerSegment = 3;
// The gated gradient rows mode's: D's (the gate's cotangent), the up's cotangent's, then the
// gate's and the up's pre-activations' (read by the epilogue warps, cut like D's).
inline constexpr int kRaggedGatedGradMapsPerSegment = 4;
inline constexpr int kRaggedMaxMapsPerSegment = 4;
inline constexpr int64_t kRaggedMapBytes = 128;
inline constexpr int64_t kRaggedSegmentBytes = 16;  // RaggedSegment
inline constexpr int64_t kRaggedAlign = 128;        // tensormap.replace edits aligned maps
// Workspace: the maps, then the segment table (one entry past the last segment), with room to
// align the start.
inline constexpr int64_t ragged_workspace_bytes(RaggedMode mode, int64_t groups, int64_t batch,
                                               int maps_per_segment) {
  const int64_t segments = ragged_segments(mode, groups, batch);
  return kRaggedAlign + segments * maps_per_segment * kRaggedMapBytes +
         (segments + 1) * kRaggedSegmentBytes;
}
inline constexpr int64_t ragged_workspace_bytes(RaggedMode mode, int64_t groups, int64_t batch) {
  return ragged_workspace_bytes(mode, groups, batch, ragged_maps_per_segment(mode));
}

// The tiles compiled for ragged products (a subset of the GEMM's, all with the TMA-store
// epilogue) and JAX_TMA_SM90_RAGGED_KERNELS(X), X(tile, layout, mode) for every compiled triple
// (the rows mode reads rhs N- or K-major, the contraction mode lhs M-major and dy N-major), are
// in contract/sm90_tiles.generated.h (the tile registry, jax_tma/_core/tiles.py).

struct RaggedArgs {
  RaggedMode mode;
  const int32_t* group_sizes;  // [batch or 1, groups]
  bool group_sizes_batched;    // false: one set of sizes for every batch entry
  bool weights_batched;        // rows mode: rhs has batch x groups matrices, else groups
  int groups;
  int batch;
  int rows;  // M, rows of each batch entry
  // The maps the prepare kernel edits per segment (address and row extent): rows mode D's
  // (map 0), contraction mode A's and B's, gated rows mode D's and the two pre-activations',
  // gated gradient rows mode D's, the up's cotangent's and the two pre-activations'; `bases`
  // and `row_bytes` of their tensors.
  const CUtensorMap* templates[kRaggedMaxMapsPerSegment];
  const void* bases[kRaggedMaxMapsPerSegment];
  int64_t row_bytes[kRaggedMaxMapsPerSegment];
  void* workspace;  // ragged_workspace_bytes
};

// Defined in sm90_ragged_dot_<in>_<out>.cu for every (Tile, Layout, mode) of
// JAX_TMA_SM90_RAGGED_KERNELS. `args` holds A's and B's maps (rows mode; contraction mode: the
// templates' encodings, unused), D's map (contraction mode; rows mode: unused), the product's
// shape (rows mode: m = batch x M stacked rows, n, k; contraction mode: m = K, n = N, k unused)
// and the stream.
template <class In, class Out, class Tile, class Layout, RaggedMode kMode>
cudaError_t launch_ragged(const LaunchArgs& args, const RaggedArgs& ragged);

// The gated rows mode's kernels, JAX_TMA_SM90_RAGGED_GATED_KERNELS(X), X(tile, layout, fusion)
// with the gated fusions of contract/sm90_dense.h, are in contract/sm90_tiles.generated.h.

// Defined in sm90_ragged_gated_<in>.cu for every (Tile, Layout, Fusion) of
// JAX_TMA_SM90_RAGGED_GATED_KERNELS, output type = input type. `args` as launch_ragged's rows
// mode, with `args.shape.n` counting accumulator columns (2 F) and `args.tmap_b` the gate's
// map; `up` the up's map; `store_pre`: write the pre-activations through the maps of
// `ragged.templates[1]` (gate) and `[2]` (up).
template <class In, class Tile, class Layout, class Fusion>
cudaError_t launch_ragged_gated(const LaunchArgs& args, const RaggedArgs& ragged,
                                const CUtensorMap& up, bool store_pre);

// The gated gradient rows mode's kernels, JAX_TMA_SM90_RAGGED_GATED_GRAD_KERNELS(X), X(tile,
// layout, fusion) with the gated gradient fusions of contract/sm90_dense.h, are in
// contract/sm90_tiles.generated.h.

// Defined in sm90_ragged_gated_grad_<in>.cu for every (Tile, Layout, Fusion) of
// JAX_TMA_SM90_RAGGED_GATED_GRAD_KERNELS, output type = input type. `args` as launch_ragged's
// rows mode with A = dy and B = w_down read K-major; `ragged.templates` D's (the gate's
// cotangent), the up's cotangent's and the gate's and the up's pre-activations' maps, the last
// three in boxes of half D's rows (the epilogue warps move them half a chunk at a time).
template <class In, class Tile, class Layout, class Fusion>
cudaError_t launch_ragged_gated_grad(const LaunchArgs& args, const RaggedArgs& ragged);

}  // namespace jax_tma::sm90_gemm
