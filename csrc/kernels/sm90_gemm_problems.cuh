// The products the sm90 GEMM kernel (kernels/sm90_gemm_kernel.cuh) computes. A problem pairs a tile
// scheduler with two lookups the kernel's roles make for every work tile: load_plan (the
// producer: which tensor maps, from which coordinates, up to which extents) and store_plan (the
// epilogue: which map, at which coordinates). The kernel body is the same for every problem.
//
//   DenseGemm       D[b] = A[b] @ B[b] over a batch, with split-K and stream-K (TileScheduler).
//   RaggedRowsGemm  A's rows in segments, each times its own B (RaggedRowScheduler). A and B
//                   through the launch's maps; D through one map per segment, in global memory,
//                   whose rows end where the segment ends: TMA clips a tile's rows past it, so
//                   no tile writes another segment's rows.
//   RaggedGatedRowsGemm
//                   the same for a gated fusion: per segment D's map, then the gate's and the
//                   up's pre-activations' (second outputs clipped like D).
//   RaggedGatedGradRowsGemm
//                   the same for the gated gradient: per segment D's map (the gate's
//                   cotangent), the up's cotangent's, then the gate's and the up's
//                   pre-activations', which the epilogue warps read (zero-filled past the
//                   segment's rows, whose outputs the stores clip).
//   RaggedKGemm     D[s] = A[rows of s] @ B[rows of s], the rows contracted (RaggedKScheduler).
//                   A and B through one map each per segment whose row extent ends where the
//                   segment ends: TMA zero-fills the last K slice past it. D through the
//                   launch's map, one batch entry per segment.
// The per-segment maps are written by the prepare kernel (kernels/sm90_ragged_prepare.cuh), so
// each thread that issues copies through them acquires them once (kGlobal*Maps).
#pragma once

#include <cuda.h>

#include "contract/sm90_gemm.h"
#include "contract/sm90_ragged_dot.h"
#include "epilogue/tma_store.cuh"
#include "mainloop/sm90_tma_wgmma.cuh"
#include "ptx/tensormap.cuh"
#include "scheduler/ragged_scheduler.cuh"
#include "scheduler/tile_scheduler.cuh"

namespace jax_tma {

// Acquires a tensor map in global memory before this thread's first copy through it (maps that
// an earlier kernel wrote must be acquired by the tensormap proxy; once per map and thread), and
// the `count` - 1 maps after it with it (a segment's second outputs after its D).
struct TensormapAcquirer {
  const CUtensorMap* last = nullptr;
  __device__ void operator()(const CUtensorMap* map, int count = 1) {
    if (map != last) {
      for (int i = 0; i < count; ++i) ptx::fence_tensormap_acquire(map + i);
      last = map;
    }
  }
};

template <class Tile>
struct DenseGemm {
  using Scheduler = TileScheduler<Tile::kBlockM, Tile::kBlockN, Tile::kClusterM>;
  using Params = typename Scheduler::Params;
  using Work = WorkTile;
  static constexpr bool kStreamK = Tile::kStreamK;
  static constexpr bool kEmptyTiles = false;  // every tile has K slices
  static constexpr bool kGlobalLoadMaps = false;
  static constexpr bool kGlobalStoreMaps = false;
  static constexpr int kSecondOutputs = 0;  // in maps after D's (none: the kernel's parameters)

  __device__ static Scheduler scheduler(const Params& p) { return Scheduler(p); }

  __device__ static LoadPlan load_plan(const Params&, const Work& w, const sm90_gemm::GemmShape& s,
                                       const CUtensorMap* a, const CUtensorMap* b) {
    // A shared operand has a batch extent of 1 in its map: always coordinate 0.
    return {a, b,
            TileOrigin{w.m_block * Tile::kBlockM, w.n_block * Tile::kBlockN,
                       s.a_batched ? w.batch : 0, s.b_batched ? w.batch : 0},
            s.m, s.n};
  }

  __device__ static StorePlan store_plan(const Params&, const Work& w,
                                         const sm90_gemm::GemmShape& s, const CUtensorMap* d,
                                         int row, int col) {
    return {d, row, col, w.batch, w.split, s.m, s.n};
  }
};

// The rows mode with kStoreMaps maps per segment in global memory: D's, then (the gated rows
// mode) its kSecondOutputs second outputs' (the pre-activations; the gated gradient: the up's
// cotangent and the two pre-activations it reads), which the epilogue finds in the maps after
// D's.
template <class Tile, int kStoreMaps>
struct RaggedRowsProblem {
  using Scheduler = RaggedRowScheduler<Tile::kBlockM, Tile::kBlockN, Tile::kClusterM,
                                       Tile::kBlockK>;
  struct Params {
    typename Scheduler::Params tiles;
    const CUtensorMap* d_maps;  // kStoreMaps per segment
  };
  using Work = RaggedWorkTile;
  static constexpr bool kStreamK = false;
  static constexpr bool kEmptyTiles = true;  // zero rows, empty groups
  static constexpr bool kGlobalLoadMaps = false;
  static constexpr bool kGlobalStoreMaps = true;
  static constexpr int kSecondOutputs = kStoreMaps - 1;

  __device__ static Scheduler scheduler(const Params& p) { return Scheduler(p.tiles); }

  // A's rows are stacked (coordinate: the segment's first row plus the tile's); B's batch
  // coordinate is the segment's weight.
  __device__ static LoadPlan load_plan(const Params&, const Work& w, const sm90_gemm::GemmShape& s,
                                       const CUtensorMap* a, const CUtensorMap* b) {
    return {a, b,
            TileOrigin{w.row_begin + w.m_block * Tile::kBlockM, w.n_block * Tile::kBlockN, 0,
                       w.batch},
            w.row_begin + w.rows, s.n};
  }

  // D's map of the segment counts rows from the segment's first.
  __device__ static StorePlan store_plan(const Params& p, const Work& w,
                                         const sm90_gemm::GemmShape& s, const CUtensorMap*,
                                         int row, int col) {
    return {p.d_maps + kStoreMaps * w.segment, row, col, 0, 0, w.rows, s.n};
  }
};

template <class Tile>
struct RaggedRowsGemm : RaggedRowsProblem<Tile, 1> {};
template <class Tile>
struct RaggedGatedRowsGemm
    : RaggedRowsProblem<Tile, sm90_gemm::kRaggedGatedMapsPerSegment> {};

template <class Tile>
struct RaggedGatedGradRowsGemm
    : RaggedRowsProblem<Tile, sm90_gemm::kRaggedGatedGradMapsPerSegment> {};

template <class Tile>
struct RaggedKGemm {
  using Scheduler = RaggedKScheduler<Tile::kBlockM, Tile::kBlockN, Tile::kClusterM,
                                     Tile::kBlockK>;
  struct Params {
    typename Scheduler::Params tiles;
    const CUtensorMap* operand_maps;  // per segment: A's map, then B's
  };
  using Work = RaggedWorkTile;
  static constexpr bool kStreamK = false;
  static constexpr bool kEmptyTiles = true;  // zero rows, empty groups
  static constexpr bool kGlobalLoadMaps = true;
  static constexpr bool kGlobalStoreMaps = false;
  static constexpr int kSecondOutputs = 0;

  __device__ static Scheduler scheduler(const Params& p) { return Scheduler(p.tiles); }

  __device__ static LoadPlan load_plan(const Params& p, const Work& w,
                                       const sm90_gemm::GemmShape& s, const CUtensorMap*,
                                       const CUtensorMap*) {
    const CUtensorMap* maps = p.operand_maps + 2 * w.segment;
    return {maps, maps + 1,
            TileOrigin{w.m_block * Tile::kBlockM, w.n_block * Tile::kBlockN, 0, 0}, s.m, s.n};
  }

  __device__ static StorePlan store_plan(const Params&, const Work& w,
                                         const sm90_gemm::GemmShape& s, const CUtensorMap* d,
                                         int row, int col) {
    return {d, row, col, w.segment, 0, s.m, s.n};
  }
};

}  // namespace jax_tma
