// sm90 GEMM kernel, device side (its host launcher: kernels/sm90_gemm_launch.cuh): D[b] =
// A[b] @ B[b] over a batch, with TMA loads (multicast across a cluster of 2), an mbarrier
// pipeline, wgmma, and a TMA-store epilogue. One instantiation per
// (In, Out, Tile, Layout, Problem): the operand layouts are compile-time (contract/sm90_gemm.h),
// and the problem (kernels/sm90_gemm_problems.cuh) says how the product is cut into work tiles
// and where each tile's operands and output lie: the dense batched GEMM here, the grouped
// (ragged) products of kernels/sm90_ragged_dot.cuh with the same body. A work tile with an
// empty K range (an empty group) stores zeros. The mainloop is a parameter too
// (TmaWgmmaMainloop: 16-bit operands; Fp8Mainloop: the FP8 products of kernels/sm90_fp8.cuh,
// whose scales it loads through the tensor maps of its own kernel parameter).
//
// Warp-specialised and persistent: warpgroup 0 produces (one elected thread issues every TMA
// copy), the other two consume (wgmma into fp32 registers, then the epilogue): both on every
// 128-row tile, or in turns on 64-row tiles (ping-pong, Tile::kPingPong). The grid walks
// (split, batch entry, tile) units through the tile scheduler; the producer fills the ring in
// the order of the units, so in ping-pong a consumer's next tile arrives while the other
// consumer's is being computed, and its own epilogue runs meanwhile. Out-of-bounds rows,
// columns and K are zero-filled by TMA on the way in and clipped by the epilogue on the way
// out; each operand's map spans one batch entry per batch index, so nothing crosses entries.
// With stream-K (Tile::kStreamK, LaunchArgs::stream_k) a unit may be a piece of a tile's K
// range: a piece that does not start the tile leaves its accumulators in the workspace
// (epilogue/partial_tiles.cuh) instead of storing them, and the piece that starts it adds the
// later CTAs' before its epilogue (scheduler/tile_scheduler.cuh).
//
// NOTE: a ping-pong consumer passes over the other's stages without waiting on them, so it
// could meet a stage's full barrier one ring pass early, where the parity of the pass it wants
// has completed already for the pass before. The consumers therefore take turns (an
// OrderedBarrier): one starts waiting on its tile's stages only after the other has seen the
// last stage of its own tile full, by which time every earlier pass has completed.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "contract/sm90_gemm.h"
#include "epilogue/direct_store.cuh"
#include "epilogue/epilogue_warps.cuh"
#include "epilogue/fusion.cuh"
#include "epilogue/fusion.h"
#include "epilogue/partial_tiles.cuh"
#include "epilogue/tma_store.cuh"
#include "kernels/sm90_gemm_problems.cuh"
#include "mainloop/sm90_tma_wgmma.cuh"
#include "pipeline/epilogue_load.cuh"
#include "pipeline/named_barrier.cuh"
#include "pipeline/ordered_barrier.cuh"
#include "ptx/cluster.cuh"
#include "ptx/common.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/warpgroup.cuh"

namespace jax_tma::sm90_gemm {

enum class WarpGroupRole { Producer = 0, Consumer0 = 1, Consumer1 = 2 };

// NOTE: 40 + 2 * 232 registers per thread-slot fit the 64K register file at 384 threads; where
// the producer warpgroup's warps 1-3 are epilogue warps (Kernel::kOffload), 56 + 2 * 224 (at 48
// the epilogue warps' code and the producer's scheduler spilled: bf16 bias + silu on 128 x 256
// tiles). Both leave 8 registers per slot free, as a sum of 512 hung the consumers' setmaxnreg.
inline constexpr int kProducerRegs = 40;
inline constexpr int kConsumerRegs = 232;
inline constexpr int kEpilogueWarpsProducerRegs = 56;
inline constexpr int kEpilogueWarpsConsumerRegs = 224;

// Shared memory a mainloop's stages take beyond the tile's budget, and whether its consumers read
// the tile's first row (kExtraSmemBytes and kAnyRowScales, where it has them: the FP8 mainloop's A
// scales from any row); else none and no.
template <class Mainloop, class = void>
struct MainloopAnyRow {
  static constexpr uint32_t kExtraSmemBytes = 0;
  static constexpr bool kReadsRow = false;
};
template <class Mainloop>
struct MainloopAnyRow<Mainloop, std::void_t<decltype(Mainloop::kExtraSmemBytes)>> {
  static constexpr uint32_t kExtraSmemBytes = Mainloop::kExtraSmemBytes;
  static constexpr bool kReadsRow = Mainloop::kAnyRowScales;
};

// The maps and arguments of a fused epilogue (epilogue/fusion.h), one kernel parameter: gated
// products read B from `b` (gate) and `b2` (up); `aux` is the [M, N] operand the epilogue reads
// (gated gradient: the gate's pre-activations, `aux2` the up's), `pre` its second output (gated:
// `pre` the gate's pre-activations, `pre2` the up's; gated gradient: the up's cotangent); all
// unused by PlainFusion.
struct FusedParams {
  CUtensorMap b2, aux, aux2, pre, pre2;
  FusionArgs args;
};

template <class In, class Out, class Tile, class Layout, template <class> class ProblemT,
          class FusionT = PlainFusion, class MainloopT = TmaWgmmaMainloop>
struct Kernel {
  using Problem = ProblemT<Tile>;
  using Fusion = FusionT;
  using Mainloop = typename MainloopT::template Apply<In, Tile, Layout, Fusion::kGated>;
  using Pipeline = typename Mainloop::Pipeline;
  using Scheduler = typename Problem::Scheduler;
  // A gated block stores half its columns: half the staging buffers hold it in one batch.
  using Epilogue = TmaStoreEpilogue<Out, Tile::kBlockN,
                                    Tile::kEpilogueBuffers / Fusion::kOutPerAcc, Fusion>;
  using Partials = PartialTiles<Mainloop::kAccRegs, Tile::kConsumerWarpgroups>;
  static_assert(Tile::kConsumerWarpgroups == kStreamKSlotsPerCta);
  static constexpr bool kTmaStore = Tile::kEpilogue == EpilogueKind::kTmaStore;
  static constexpr bool kStreamK = Tile::kStreamK && Problem::kStreamK;
  static_assert(kTmaStore || !Problem::kGlobalStoreMaps, "per-segment outputs store through TMA");

  // Ping-pong: the consumers' turns at waiting on the ring (see the note at the top).
  using Turns = OrderedBarrier<Tile::kConsumerWarpgroups, 1>;

  // Cooperative tiles hand a fused block to the epilogue warps (epilogue/epilogue_warps.cuh):
  // always, where the fusion reads no [M, N] operand (gated) or where the shared memory holds
  // a ring for the residual's chunks besides the tile's (kAuxRing); else only without a
  // residual (a run-time choice, offload()). An activation gradient, which always reads its
  // pre-activation, only with the ring; a gated gradient is compiled only where it is (its
  // two pre-activations and two outputs pass through the ring: the warps alone finish it).
  // Ping-pong tiles hide their epilogue under the other consumer's mainloop already.
  // Where the problem keeps D's maps per segment in global memory (then its second outputs' after
  // each), the warps store through those.
  static constexpr int kSegmentMaps = Problem::kGlobalStoreMaps ? 1 + Problem::kSecondOutputs : 0;
  using Warps = EpilogueWarps<Out, Tile::kBlockN, Fusion, kSegmentMaps>;
  // (The ring follows the staging, the barriers and the handoff slots: 1024 bytes at most.)
  static constexpr uint32_t kMaxSmemBytes = 227 * 1024;
  static constexpr bool kAuxRingFits =
      Tile::kRingBytes + Tile::kEpilogueBytes + 1024 + sizeof(typename Warps::AuxRing) + 1023 <=
      kMaxSmemBytes;
  static constexpr bool kOffload =
      kTmaStore && !Tile::kPingPong && Warps::kApplies &&
      Tile::kEpilogueBuffers == Warps::kChunks &&
      ((Fusion::kKind != FusionKind::kActivationGrad &&
        Fusion::kKind != FusionKind::kGatedGrad) ||
       kAuxRingFits);
  static constexpr bool kAuxRing = kOffload && Fusion::kMayReadAux && kAuxRingFits;
  static constexpr bool kOffloadAlways = kOffload && (!Fusion::kMayReadAux || kAuxRing);
  static_assert(Fusion::kKind != FusionKind::kGatedGrad || kAuxRing,
                "the gated gradient is finished by the epilogue warps through their ring");
  __device__ static bool offload(const FusionArgs& args) {
    return kOffloadAlways || (kOffload && !args.aux);
  }
  static_assert(!kOffload || Tile::kConsumerWarpgroups == 2);
  // Whether the consumers store a CTA's last tile themselves (kOffload): the epilogue warps'
  // pass over it would run with every tensor core idle. Not a residual the warps read through
  // their ring (the consumers' own residual pass spilled at their 224 registers: bias + silu +
  // residual on 128 x 256 tiles); so the consumers' epilogue here reads an [M, N] operand only
  // where the kernel may not offload (kStoreReadsAux). Never a gated gradient (its epilogue
  // is the warps' alone).
  __device__ static bool stores_last_tile(const FusionArgs& args) {
    return Fusion::kKind != FusionKind::kGatedGrad && !(kAuxRing && args.aux);
  }
  static constexpr bool kStoreReadsAux = Fusion::kMayReadAux && !kOffloadAlways;
  static constexpr int kProducerRegs =
      kOffload ? kEpilogueWarpsProducerRegs : jax_tma::sm90_gemm::kProducerRegs;
  static constexpr int kConsumerRegs =
      kOffload ? kEpilogueWarpsConsumerRegs : jax_tma::sm90_gemm::kConsumerRegs;

  struct Empty {};
  struct SharedStorage {
    typename Mainloop::SharedStorage operands;
    // One staging ring per consumer warpgroup (none for the direct-store epilogue).
    std::conditional_t<kTmaStore,
                       std::conditional_t<kOffload, typename Warps::SharedStorage,
                                          typename Epilogue::SharedStorage>,
                       Empty>
        staging[Tile::kConsumerWarpgroups];
    typename Pipeline::SharedStorage barriers;
    uint64_t aux_load[Tile::kConsumerWarpgroups];  // fused epilogues that read an operand
    typename Turns::SharedStorage turns;  // used in ping-pong only
    StagedHandoff::SharedStorage handoff[Tile::kConsumerWarpgroups];  // kOffload only
    uint64_t aux_loaded[Warps::kAuxSlots];                             // kAuxRing only
    std::conditional_t<kAuxRing, typename Warps::AuxRing, Empty> aux_ring;
  };
  // The base is aligned up by at most 1023 bytes inside the dynamic allocation.
  // (sizeof would count the tail padding up to the 1024-byte alignment, which is never used.)
  // The tile's budget (contract/sm90_gemm.h) and what the mainloop's stages take beyond it, or
  // more for the residual's ring.
  static constexpr uint32_t kSmemBytes =
      kAuxRing ? offsetof(SharedStorage, aux_ring) + sizeof(SharedStorage::aux_ring) + 1023
               : Tile::kSmemBytes + MainloopAnyRow<Mainloop>::kExtraSmemBytes;
  static_assert(offsetof(SharedStorage, aux_ring) +
                    (kAuxRing ? sizeof(SharedStorage::aux_ring) : 0) + 1023 <=
                kSmemBytes);
  static_assert(kSmemBytes <= kMaxSmemBytes);

  // Warpgroup `w`'s staging area as its own epilogue uses it: with epilogue warps, the first
  // of the chunks it hands them (a gated block stores half as many; the warpgroup stores a
  // CTA's last tile itself).
  using EpilogueStaging = typename Epilogue::SharedStorage;
  __device__ static EpilogueStaging& staging(SharedStorage& smem, int w) {
    static_assert(!kTmaStore || sizeof(EpilogueStaging) <= sizeof(smem.staging[0]));
    return *reinterpret_cast<EpilogueStaging*>(&smem.staging[w]);
  }
  static_assert(!kTmaStore || sizeof(SharedStorage::staging) <= Tile::kEpilogueBytes);
  static_assert(kTmaStore || std::is_same_v<Fusion, PlainFusion>, "fusion needs TMA stores");
  static_assert(Epilogue::kChunkBytes == Tile::kEpilogueChunkBytes);
  static_assert(Epilogue::kChunkCols * sizeof(Out) == Tile::kEpilogueRowBytes);
};

template <class In, class Out, class Tile, class Layout, template <class> class ProblemT,
          class FusionT, class MainloopT>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    sm90_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                     const __grid_constant__ CUtensorMap tmap_b,
                     const __grid_constant__ CUtensorMap tmap_d, Out* __restrict__ d,
                     GemmShape shape,
                     typename Kernel<In, Out, Tile, Layout, ProblemT, FusionT,
                                     MainloopT>::Problem::Params params,
                     typename Kernel<In, Out, Tile, Layout, ProblemT, FusionT,
                                     MainloopT>::Partials partials,
                     const __grid_constant__ FusedParams fused,
                     const __grid_constant__ typename Kernel<In, Out, Tile, Layout, ProblemT,
                                                             FusionT, MainloopT>::Mainloop::Params
                         mainloop) {
  using K = Kernel<In, Out, Tile, Layout, ProblemT, FusionT, MainloopT>;
  using F = FusionT;
  using P = typename K::Problem;
  extern __shared__ uint8_t smem_raw[];
  auto& smem = *reinterpret_cast<typename K::SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});

  // With Mainloop::kUniformRole, lane 0's warpgroup index (the compiler cannot prove
  // threadIdx.x / 128 uniform): the role branches are then uniform, and what the consumers
  // compute from it per K slice (the FP8 mainloop's descriptors) stays on the uniform datapath.
  // (The 16-bit kernels spill with it on 128 x 256 tiles: ptxas 13.0.)
  const int warpgroup_index = static_cast<int>(threadIdx.x / 128);
  const auto role = static_cast<WarpGroupRole>(
      K::Mainloop::kUniformRole ? __shfl_sync(0xffffffffu, warpgroup_index, 0) : warpgroup_index);
  if (threadIdx.x == 32) {  // not thread 0: the barriers' initialisation need not wait on these
    ptx::prefetch_tensormap(&tmap_a);
    ptx::prefetch_tensormap(&tmap_b);
    if constexpr (K::kTmaStore) ptx::prefetch_tensormap(&tmap_d);
    K::Mainloop::prefetch(mainloop);
  }
  if (threadIdx.x == 0) {
    K::Pipeline::init(smem.barriers, Tile::kStageReaderWarps * Tile::kClusterM);
    if constexpr (Tile::kPingPong) K::Turns::init(smem.turns, 128);  // a warpgroup arrives
    if constexpr (K::kAuxRing) {
      for (int i = 0; i < K::Warps::kAuxSlots; ++i) EpilogueLoad::init(&smem.aux_loaded[i]);
    }
    K::Mainloop::init(smem.operands);
    if constexpr (F::kMayReadAux) {
      for (int i = 0; i < Tile::kConsumerWarpgroups; ++i) EpilogueLoad::init(&smem.aux_load[i]);
    }
    ptx::fence_mbarrier_init();
  }
  // The producer's first work unit and share of the shape are the kernel's first reads of its
  // launch parameters. Made here, their constant-cache misses overlap the barrier below; made
  // after it, they held the first TMA copy back by ~1200 cycles (1000^3 in pairs on an H100,
  // clock64 marks: first copy ~2800 cycles after the CTA's start, ~1600 with this). The
  // consumers read the same parameters after the barrier, from the warm cache.
  const auto scheduler = P::scheduler(params);
  typename P::Work first{};
  GemmShape local = {};
  if (role == WarpGroupRole::Producer) {
    first = scheduler.first();
    local = shape;
    ptx::compute_now(first.linear, first.m_block, first.n_block, first.batch, first.k_begin,
                     first.k_end, first.self_valid, first.cluster_full, local.a_stage_bytes,
                     local.m, local.n, local.a_batched, local.b_batched);
  }
  // Peers multicast into this CTA's ring and arrive on its barriers: none may use them before
  // all are initialised (fence_mbarrier_init orders the initialisation before the relaxed
  // arrival). Each role waits only after its register hand-over.
  if constexpr (Tile::kClusterM > 1) {
    ptx::cluster_arrive_relaxed();
  } else {
    __syncthreads();
  }
  const auto wait_for_peers = [] {
    if constexpr (Tile::kClusterM > 1) ptx::cluster_wait();
  };

  typename K::Pipeline pipeline{smem.barriers};

  if (role == WarpGroupRole::Producer) {
    ptx::setmaxnreg_dec<K::kProducerRegs>();
    wait_for_peers();
    if (threadIdx.x / 32 == 0 && ptx::elect_one_sync()) {
      auto write = make_producer_start_state<Tile::kStages>();
      TensormapAcquirer acquire_a, acquire_b;
      bool odd = false;
      for (auto w = first; scheduler.valid(w); w = scheduler.next(w), odd = !odd) {
        const LoadMode mode = !w.self_valid       ? LoadMode::kIdle
                              : Tile::kClusterM > 1 && w.cluster_full ? LoadMode::kMulticast
                                                                       : LoadMode::kSolo;
        // An idle CTA's M block may lie past the matrix: its plan is never read.
        LoadPlan plan = w.self_valid ? P::load_plan(params, w, local, &tmap_a, &tmap_b)
                                     : LoadPlan{};
        // Every other unit of this CTA loads its K slices last to first. The CTAs of a wave
        // run their K loops about in step, so the next wave starts on the slices this one read
        // last, while they are still in L2 (H100, 16384 x 4096 x 4096: 780 -> 566 MB read from
        // DRAM). Stream-K's pieces, the last wave's, keep their order.
        plan.reverse_k = odd && w.piece < 0;
        if constexpr (F::kGated) {  // B's blocks alternate gate and up over half the columns
          plan.b2 = &fused.b2;
          plan.at.n0 /= 2;
          plan.cols /= 2;
        }
        if constexpr (P::kGlobalLoadMaps) {
          if (w.self_valid && w.k_end > w.k_begin) {
            acquire_a(plan.a);
            acquire_b(plan.b);
          }
        }
        K::Mainloop::load(pipeline, write, smem.operands, plan, w.k_begin, w.k_end, mode,
                          scheduler.rank, local.a_stage_bytes, mainloop);
      }
      pipeline.producer_tail(write);
    } else if constexpr (K::kOffload) {  // warps 1-3: the epilogue warps
      if (threadIdx.x / 32 != 0 && K::offload(fused.args)) {
        typename K::Warps::AuxRing* ring = nullptr;
        if constexpr (K::kAuxRing) ring = &smem.aux_ring;
        K::Warps::run(smem.staging, smem.handoff,
                      {fused.args, &fused.aux, &fused.aux2, &fused.pre, &fused.pre2}, ring,
                      smem.aux_loaded);
      }
    }
  } else {
    ptx::setmaxnreg_inc<K::kConsumerRegs>();
    wait_for_peers();
    const int warpgroup = static_cast<int>(role) - static_cast<int>(WarpGroupRole::Consumer0);
    const NamedBarrier epilogue_barrier{
        static_cast<uint32_t>(NamedBarrierId::kEpilogue0) + warpgroup, 128};
    auto read = make_consumer_start_state<Tile::kStages>();
    // Ping-pong: this warpgroup's A rows are the whole 64-row tile, and it takes every other
    // unit; cooperative: its 64 rows of every 128-row tile.
    const int a_block = Tile::kPingPong ? 0 : warpgroup;
    int turn = 0;
    typename K::Turns turns{smem.turns, static_cast<uint32_t>(warpgroup)};
    auto hand_over = [&] {  // this tile's last stage is full: the other consumer may wait
      if constexpr (Tile::kPingPong) turns.arrive();
    };
    TensormapAcquirer acquire_d;
    EpilogueLoad aux_load{&smem.aux_load[warpgroup]};
    const FusedStore fused_store{&fused.aux, &fused.pre, &fused.pre2, fused.args, &aux_load};
    // The maps a segment's tile acquires before its stores: D's, and its second outputs' where
    // the problem keeps them after D's and the fusion stores them.
    const int store_maps = 1 + (fused.args.store_pre ? P::kSecondOutputs : 0);
    float acc[K::Mainloop::kAccRegs];
    bool closed = false;  // kOffload: this warpgroup has no more blocks for the epilogue warps
    for (auto w = scheduler.first(); scheduler.valid(w); w = scheduler.next(w), ++turn) {
      const int count = w.k_end - w.k_begin;
      if (Tile::kPingPong && turn % 2 != warpgroup) {
        read.advance(static_cast<uint32_t>(count));  // the other consumer's stages
        continue;
      }
      if constexpr (Tile::kPingPong) turns.wait();
      if (!w.self_valid) {
        K::Mainloop::skip(pipeline, read, count, hand_over);
        continue;
      }
      const int row0 = w.m_block * Tile::kBlockM + 64 * a_block;
      const int col0 = w.n_block * (Tile::kBlockN / F::kOutPerAcc);
      if constexpr (P::kEmptyTiles) {
        // Nothing to contract (an empty group): the block is zero. (Written apart from the
        // accumulators: wgmma's registers written on a divergent path serialise it.)
        if (count == 0) {
          hand_over();
          StorePlan to = P::store_plan(params, w, shape, &tmap_d, row0, col0);
          if constexpr (F::kGated) to.cols /= 2;
          if constexpr (K::kOffload) {
            // The staging buffers are the epilogue warps': a block of zeros goes through them
            // (the gated fusion of zeros is zero, and so are its pre-activations; a gated
            // gradient's two cotangents are stored as zeros).
            if (K::offload(fused.args)) {
              K::Warps::hand_off_zeros(smem.staging[warpgroup], smem.handoff[warpgroup], to,
                                       warpgroup);
              continue;
            }
          }
          if (to.row >= to.rows) continue;
          if constexpr (P::kGlobalStoreMaps) {
            if (threadIdx.x % 128 == 0) acquire_d(to.d, store_maps);
          }
          K::Epilogue::store_zeros(K::staging(smem, warpgroup), to, epilogue_barrier);
          if constexpr (P::kSecondOutputs > 0) {
            for (int i = 1; i < store_maps; ++i) {  // zero pre-activations too
              StorePlan pre = to;
              pre.d = to.d + i;
              K::Epilogue::store_zeros(K::staging(smem, warpgroup), pre, epilogue_barrier);
            }
          }
          continue;
        }
      }
      // A cooperative tile whose rows end within the first warpgroup's 64 (a group's last row
      // block, the matrix's last): the second warpgroup's rows hold no output, so it passes over
      // the tile's stages without issuing wgmma and the tensor core serves the first alone.
      // With epilogue warps it hands over a block to skip, except on the CTA's last tile. There
      // it hands over nothing even where the other warpgroup hands its rows to the warps (a
      // residual through their ring, !stores_last_tile): a skip block stores nothing, and the
      // warps take each warpgroup's blocks until that warpgroup closes, so the two counts
      // need not match.
      // Not for a stream-K piece, whose partial sums other CTAs wait for.
      if constexpr (!Tile::kPingPong && K::Mainloop::kWarpgroupsIndependent) {
        const StorePlan to = P::store_plan(params, w, shape, &tmap_d, row0, col0);
        if (to.row >= to.rows && !(K::kStreamK && w.piece >= 0)) {
          K::Mainloop::skip(pipeline, read, count, hand_over);
          if constexpr (K::kOffload) {
            if (K::offload(fused.args) && !scheduler.last(w)) {
              K::Warps::hand_off(acc, smem.staging[warpgroup], smem.handoff[warpgroup], to,
                                 warpgroup);
            }
          }
          continue;
        }
      }
      // Fused epilogues that read an operand load its first batch while the mainloop runs
      // (not after storing a pre-activation through the same buffers, and not for a stream-K
      // piece, which may leave its sums to another CTA).
      // NOTE: at one K slice in every CTA, the grid's aux loads (64 KB per CTA on 128 x 256
      // tiles) reached DRAM at once, beside the operands' loads; staggered by CTA over the K
      // range, a residual's and a bias + residual's epilogues cost less over the plain product
      // (docs/notebook/2026-11-29-tile-registry-figures.md).
      const int prefetch_slice =
          count >= 16 ? K::Mainloop::kMidwaySlice + (blockIdx.x % 8) * ((count - 8) / 8)
                      : K::Mainloop::kMidwaySlice;
      bool prefetched = false;
      bool midway_done = false;
      auto midway = [&](int kb) {  // once, from slice prefetch_slice (or at the end)
        if (midway_done || (kb < prefetch_slice && kb < count)) return;
        midway_done = true;
        if constexpr (K::kTmaStore && F::kMayReadAux && !K::kStreamK && !K::kOffloadAlways) {
          if (fused.args.aux && !fused.args.store_pre) {
            const StorePlan to = P::store_plan(params, w, shape, &tmap_d, row0, col0);
            if (to.row < to.rows) {
              if (threadIdx.x % 128 == 0) {
                K::Epilogue::prefetch_aux(smem.staging[warpgroup], to, fused_store);
              }
              prefetched = true;
            }
          }
        }
      };
      // The tile's first row in A's coordinates (the problem's load plan) only for a mainloop
      // whose scales depend on it.
      TileOrigin at{0, w.n_block * Tile::kBlockN, 0, 0};
      if constexpr (MainloopAnyRow<typename K::Mainloop>::kReadsRow) {
        at.m0 = P::load_plan(params, w, shape, &tmap_a, &tmap_b).at.m0;
      }
      K::Mainloop::mma(pipeline, read, smem.operands, a_block, at, count,
                       acc, hand_over, midway, mainloop);
      if constexpr (K::kStreamK) {
        if (w.piece >= 0) {
          if (w.k_begin > 0) {  // not the tile's head: leave the partial sums for it
            partials.store(scheduler.cluster, warpgroup, acc, epilogue_barrier);
            continue;
          }
          // The head: the CTAs after this one computed the rest of the tile's K range.
          int cta = scheduler.cluster;
          for (int done = w.k_end; done < params.k_blocks; done += scheduler.range_length(cta)) {
            ++cta;
            partials.accumulate(cta, warpgroup, acc, epilogue_barrier);
          }
        }
      }
      if constexpr (K::kTmaStore) {
        StorePlan to = P::store_plan(params, w, shape, &tmap_d, row0, col0);
        if constexpr (F::kGated) to.cols /= 2;
        if constexpr (K::kOffload) {
          if (K::offload(fused.args)) {
            if (!scheduler.last(w) || !K::stores_last_tile(fused.args)) {
              K::Warps::hand_off(acc, smem.staging[warpgroup], smem.handoff[warpgroup], to,
                                 warpgroup);
              continue;
            }
            // The CTA's last tile: the epilogue warps' pass over it would run with every
            // tensor core idle, so the warpgroup (idle too now) stores it itself, fused, in
            // the staging buffers the warps give back on closing.
            K::Warps::close(smem.handoff[warpgroup], warpgroup);
            closed = true;
          }
        }
        if (to.row < to.rows) {  // else this warpgroup's rows lie past D's
          if constexpr (P::kGlobalStoreMaps) {
            if (threadIdx.x % 128 == 0) acquire_d(to.d, store_maps);
          }
          FusedStore tile_store = fused_store;
          if constexpr (P::kSecondOutputs > 0) {  // the segment's, after its D's
            tile_store.pre = to.d + 1;
            tile_store.pre2 = to.d + 2;
          }
          K::Epilogue::template store<K::kStoreReadsAux>(acc, K::staging(smem, warpgroup), to,
                                                          epilogue_barrier, tile_store,
                                                          prefetched);
        }
        // Closed: the last unit (and nothing held across the store, where the consumers'
        // registers are 224).
        if (closed) break;
      } else {
        Out* d_matrix = d + w.split * shape.d_split_stride + w.batch * shape.d_batch_stride;
        DirectStoreEpilogue<Out, Tile::kBlockN>::store(acc, d_matrix, shape.m, shape.n,
                                                       shape.d_m_stride, row0, col0);
      }
    }
    if constexpr (K::kOffload) {
      if (K::offload(fused.args) && !closed) K::Warps::close(smem.handoff[warpgroup], warpgroup);
    }
    if constexpr (K::kTmaStore) K::Epilogue::finish();
  }
}

}  // namespace jax_tma::sm90_gemm
