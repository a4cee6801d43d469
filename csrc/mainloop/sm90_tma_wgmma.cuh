// Mainloop of the sm90 GEMM: TMA fills a ring of (A, B) stages, the consumer warpgroups run
// wgmma on them. The operand layouts (contract/sm90_gemm.h, OperandLayout) are template
// parameters: they pick the boxes, the copies' coordinate order and wgmma's transpose
// immediates at compile time, so no layout test runs per K slice.
//
// Shared-memory layouts (all 128-byte swizzled, each stage and box 1024-byte aligned):
//   A stage, K-major: kBlockM rows x 64 K (one 128-byte row per M index), in boxes of 64 rows.
//            M-major: kBlockM / 64 blocks, each 64 K-rows x 64 M.
//   B stage, N-major: kBlockN / 64 blocks (rounded up), each 64 K-rows x 64 N.
//            K-major: kBlockN rows x 64 K (one 128-byte row per N index), in blocks of 64 rows
//            (rounded up to whole blocks).
// A consumer warpgroup multiplies one 64-row block of the A stage, block r holding M indices
// [64r, 64r + 64) (in both A layouts the 8 KB at offset r * 8 KB), by the whole B stage.
//
// Clusters (Tile::kClusterM = 2): both CTAs of a cluster work on the same N block, batch entry
// and K range, so their B slices are equal. When both M blocks exist (LoadMode::kMulticast)
// CTA r loads B's 64-wide blocks j with j % 2 == r and multicasts them to both; when the
// peer's M block lies past the matrix, this CTA loads all of B itself (kSolo) and the peer
// only keeps its ring in step (kIdle: no copies, an arrival with no bytes). Every consumer
// warp that reads a stage releases it to the empty barriers of all CTAs of the cluster,
// whatever the mode, so a producer never multicasts into a peer stage that the peer has not
// yet re-armed; empty barriers count the warps that read a stage (Tile::kStageReaderWarps: one
// warpgroup's in ping-pong) x cluster CTAs.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "contract/sm90_gemm.h"
#include "pipeline/tma_pipeline.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace jax_tma {

enum class LoadMode { kMulticast, kSolo, kIdle };

// Where one output tile's operands start: its first M and N index and, per operand, the batch
// coordinate in that operand's tensor map (0 for an operand shared by every batch entry).
struct TileOrigin {
  int m0, n0;
  int batch_a, batch_b;
};

// Where one work tile's operands come from: the maps (kernel parameters, or maps in global
// memory), the tile's origin in them, and A's M extent and B's N extent in the maps'
// coordinates (boxes wholly past them are not loaded: boxes_within).
struct LoadPlan {
  const CUtensorMap* a;
  const CUtensorMap* b;
  TileOrigin at;
  int rows;
  int cols;
  const CUtensorMap* b2;  // kPairedB: the second B (B's odd blocks)
  bool reverse_k;         // the K slices last to first (the consumers only count them)

  // The K slice that the `i`-th stage of the range [begin, end) loads.
  __device__ int slice(int i, int begin, int end) const {
    return reverse_k ? begin + end - 1 - i : i;
  }
};

// kPairedB: B's 64-wide blocks alternate two maps, `b` and `b2`, over the same columns (block j
// holds columns at.n0 + 64 (j / 2) of map j % 2): the gate and up weights of a gated product,
// multiplied in one pass and paired by the epilogue (epilogue/fusion.cuh).
template <class T, class Tile, class Layout, bool kPairedB = false>
struct MainloopSm90TmaWgmma {
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kBlockK = Tile::kBlockK;
  static constexpr int kStages = Tile::kStages;
  static constexpr int kClusterM = Tile::kClusterM;
  static constexpr uint32_t kClusterMask = (1u << kClusterM) - 1;
  static constexpr int kWgmmaK = 16;
  static constexpr int kAccRegs = kBlockN / 2;
  static constexpr sm90_gemm::Major kMajorA = Layout::kA;
  static constexpr sm90_gemm::Major kMajorB = Layout::kB;
  using Boxes = sm90_gemm::OperandBoxes<Tile, Layout>;
  static constexpr int kABoxElems = Boxes::kABoxBytes / sizeof(T);
  static constexpr int kBBoxElems = Boxes::kBBoxBytes / sizeof(T);
  // One 64-row block of the A stage: what one consumer warpgroup multiplies.
  static constexpr int kAWarpgroupElems = 64 * kBlockK;

  using Pipeline = PipelineTmaAsync<kStages>;
  using State = typename Pipeline::State;
  using Mma = ptx::WgmmaSS<kBlockN, T>;

  struct SharedStorage {
    alignas(1024) T a[kStages][kBlockM * kBlockK];
    alignas(1024) T b[kStages][kBlockK * Tile::kBColumnBlocks * Tile::kBBlockN];  // whole blocks
  };
  static_assert(sizeof(T) == Tile::kElementBytes);
  static_assert(sizeof(SharedStorage::a[0]) == Tile::kTileABytes);
  static_assert(sizeof(SharedStorage::b[0]) == Tile::kTileBBytes);
  static_assert(kABoxElems == kAWarpgroupElems, "an A box is one warpgroup's share");
  static_assert(Boxes::kBBoxMN == Tile::kBBlockN && kBBoxElems == Tile::kBBlockN * kBlockK);

  // An operand's boxes (`boxes` of `box` M or N indices from index `from`) that hold indices of
  // a matrix of `extent`. The rest lie wholly past the matrix: they are not loaded, and the
  // stale rows or columns wgmma reads in their place reach only outputs past the matrix,
  // which no epilogue stores. TMA's zero fill of such boxes cost whole microseconds: on an
  // H100, 128 x 232 pairs ran 3072 x 1024 x 3072 (two of the last column's four B blocks past
  // the matrix) in 39.0 us with them, 33.1 without.
  // (`from` < `extent`: written so that an extent near 2^31 does not wrap.)
  __device__ static int boxes_within(int boxes, int box, int extent, int from) {
    return min(boxes, (extent - from - 1) / box + 1);
  }

  // The consumer warpgroups of a cooperative tile run apart: one may skip() a tile whose rows
  // it does not reach while the other runs mma() on it.
  static constexpr bool kWarpgroupsIndependent = true;
  // The kernel's role branches need not be provably warp-uniform (see the FP8 mainloop's).
  static constexpr bool kUniformRole = false;

  // The tensor maps a mainloop reads besides A's and B's (kernel parameter): none here.
  struct Params {};
  __device__ static void prefetch(const Params&) {}
  // One thread, before the kernel's fence_mbarrier_init: barriers of the mainloop's own (none).
  __device__ static void init(SharedStorage&) {}

  // How many of the tile's A and B boxes hold indices of the matrix (boxes_within).
  __device__ static int a_loads(const LoadPlan& plan) {
    return boxes_within(Boxes::kALoads, Boxes::kABoxMN, plan.rows, plan.at.m0);
  }
  __device__ static int b_loads(const LoadPlan& plan) {
    const int within = boxes_within(Boxes::kBLoads, Boxes::kBBoxMN, plan.cols, plan.at.n0);
    return kPairedB ? min(Boxes::kBLoads, 2 * within) : within;
  }
  // The bytes they bring into one stage; `a_stage_bytes` is what all of A's boxes bring
  // (GemmShape::a_stage_bytes).
  __device__ static uint32_t stage_bytes(int a_loads, int b_loads, uint32_t a_stage_bytes) {
    return a_stage_bytes / Boxes::kALoads * a_loads + b_loads * Boxes::kBBoxBytes;
  }

  // The copies of K slice `kb` into stage `stage` (`a_loads` of A's boxes, `b_loads` of B's),
  // completing on `full` (modes other than kIdle). Whoever issues them, every byte of A and B
  // lands in this CTA's stage.
  __device__ static void copy_stage(SharedStorage& smem, int stage, const LoadPlan& plan,
                                    int a_loads, int b_loads, int kb, LoadMode mode, int rank,
                                    uint64_t* full) {
    const TileOrigin& at = plan.at;
    const int k0 = kb * kBlockK;
#pragma unroll
    for (int i = 0; i < Boxes::kALoads; ++i) {
      if (i >= a_loads) break;
      const auto c = sm90_gemm::inner_outer<kMajorA>(at.m0 + i * Boxes::kABoxMN, k0);
      ptx::tma_load(smem.a[stage] + i * kABoxElems, plan.a, full,
                    ptx::TmaCoord<3>{{c.inner, c.outer, at.batch_a}});
    }
#pragma unroll
    for (int j = 0; j < Boxes::kBLoads; ++j) {
      if (j >= b_loads) break;
      T* dst = smem.b[stage] + j * kBBoxElems;
      const int n = at.n0 + (kPairedB ? j / 2 : j) * Boxes::kBBoxMN;
      const CUtensorMap* map = kPairedB && (j % 2) ? plan.b2 : plan.b;
      const auto c = sm90_gemm::inner_outer<kMajorB>(n, k0);
      const ptx::TmaCoord<3> coord{{c.inner, c.outer, at.batch_b}};
      if (mode == LoadMode::kSolo) {
        ptx::tma_load(dst, map, full, coord);
      } else if (j % kClusterM == rank) {
        ptx::tma_load_multicast(dst, map, full, kClusterMask, coord);
      }
    }
  }

  // Producer (one thread): the ring loop of every mainloop. For each K slice of
  // [kb_begin, kb_end) of one output tile, in descending order where plan.reverse_k, waits for
  // a free stage, arms its full barrier for `bytes` and calls copy(stage, kb, full) to issue the
  // copies; in kIdle mode only keeps the ring in step (an arrival with no bytes, no copies).
  template <class CopyStage>
  __device__ static void fill_stages(Pipeline& pipeline, State& write, const LoadPlan& plan,
                                     int kb_begin, int kb_end, LoadMode mode, uint32_t bytes,
                                     CopyStage&& copy) {
#pragma unroll 1
    for (int i = kb_begin; i < kb_end; ++i) {
      pipeline.producer_acquire(write);
      if (mode == LoadMode::kIdle) {
        pipeline.producer_expect_tx(write, 0);
      } else {
        copy(write.index, plan.slice(i, kb_begin, kb_end),
             pipeline.producer_expect_tx(write, bytes));
      }
      ++write;
    }
  }

  // Producer (one thread): stream K slices [kb_begin, kb_end) of one output tile into the ring
  // (fill_stages). `rank` is this CTA's rank in its cluster; `a_stage_bytes` what all of A's
  // boxes bring per stage (GemmShape::a_stage_bytes). `plan` is read only in modes other than
  // kIdle.
  __device__ static void load(Pipeline& pipeline, State& write, SharedStorage& smem,
                              const LoadPlan& plan, int kb_begin, int kb_end, LoadMode mode,
                              int rank, uint32_t a_stage_bytes, const Params&) {
    const int a = a_loads(plan);
    const int b = b_loads(plan);
    fill_stages(pipeline, write, plan, kb_begin, kb_end, mode, stage_bytes(a, b, a_stage_bytes),
                [&](int stage, int kb, uint64_t* full) {
                  copy_stage(smem, stage, plan, a, b, kb, mode, rank, full);
                });
  }

  // Descriptor of the k16 step `kk` of an operand tile at `tile` whose boxes are `kBoxBytes`
  // apart, in either layout. Both swizzle 128 bytes, with 8-row groups 1024 bytes apart.
  //   K-major: the step moves 32 bytes along the swizzled rows (the leading offset is unused).
  //   MN-major: the step moves 16 K-rows of 128 bytes; 64-wide M or N blocks are one box apart
  //   (for A, wgmma's M = 64 spans one).
  template <sm90_gemm::Major kMajor, uint32_t kBoxBytes>
  __device__ static uint64_t desc(const T* tile, int kk) {
    if constexpr (kMajor == sm90_gemm::Major::kK) {
      return ptx::make_smem_desc(tile + kk * kWgmmaK, 0, 1024, ptx::WgmmaSwizzle::k128B);
    } else {
      return ptx::make_smem_desc(tile + kk * kWgmmaK * Tile::kSwizzleElems, kBoxBytes, 1024,
                                 ptx::WgmmaSwizzle::k128B);
    }
  }

  // One K slice: four wgmma k16 steps on stage `stage`, A's row block `a_block`, into `acc`.
  __device__ static void issue(const SharedStorage& smem, int stage, int a_block,
                               float (&acc)[kAccRegs], bool overwrite) {
    const T* a = smem.a[stage] + a_block * kAWarpgroupElems;
    const T* b = smem.b[stage];
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / kWgmmaK; ++kk) {
      Mma::template mma<static_cast<int>(kMajorA), static_cast<int>(kMajorB)>(
          acc, desc<kMajorA, Boxes::kABoxBytes>(a, kk), desc<kMajorB, Boxes::kBBoxBytes>(b, kk),
          (overwrite && kk == 0) ? 0 : 1);
    }
    ptx::wgmma_commit_group();
  }

  // Consumer: wait until slice `kb` of `k_blocks` is in its stage (unless an earlier
  // consumer_probe found it `full`); once the tile's last is, run the caller's `waited` hook
  // (the epilogue's: the tile's stages are all full).
  template <class Waited>
  __device__ static void wait_slice(Pipeline& pipeline, const State& s, int kb, int k_blocks,
                                    Waited& waited, bool full = false) {
    if (!full) pipeline.consumer_wait(s);
    if (kb == k_blocks - 1) waited();
  }

  // Every lane of a consumer warp: this warp is done reading the stage.
  __device__ static void release(Pipeline& pipeline, const State& s) {
    if constexpr (kClusterM == 1) {
      if (threadIdx.x % 32 == 0) pipeline.consumer_release(s);
    } else {
      pipeline.consumer_release_cluster(s, kClusterMask);
    }
  }

  // First K slice after which mma() calls its `midway` hook: late enough that the epilogue's
  // stores of the previous tile have read their staging buffers.
  static constexpr int kMidwaySlice = 4;

  // Consumer warpgroup: accumulate A's row block `a_block` of one output tile over `k_blocks`
  // (>= 1) slices (`at`, the tile's first row and column, is for mainloops with block scales).
  // Keeps one wgmma group in flight and releases each stage as soon as the group reading it has
  // retired. `waited()` runs once the tile's last stage is known full; `midway(kb)` after each
  // slice kb >= kMidwaySlice is issued, and `midway(k_blocks)` at the end: the epilogue's
  // prefetch hook, which picks its slice (it must act once, at the end at the latest).
  template <class Waited, class Midway>
  __device__ static void mma(Pipeline& pipeline, State& read, const SharedStorage& smem,
                             int a_block, const TileOrigin& /*at*/, int k_blocks,
                             float (&acc)[kAccRegs], Waited&& waited, Midway&& midway,
                             const Params& = {}) {
    wait_slice(pipeline, read, 0, k_blocks, waited);
    ptx::wgmma_fence_operands(acc);
    issue(smem, read.index, a_block, acc, true);
    State in_flight = read;
    ++read;
#pragma unroll 1
    for (int kb = 1; kb < k_blocks; ++kb) {
      wait_slice(pipeline, read, kb, k_blocks, waited);
      issue(smem, read.index, a_block, acc, false);
      if (kb >= kMidwaySlice) midway(kb);
      ptx::wgmma_wait_group<1>();
      release(pipeline, in_flight);
      in_flight = read;
      ++read;
    }
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(acc);
    release(pipeline, in_flight);
    midway(k_blocks);
  }

  // Consumer warpgroup of an idle CTA (LoadMode::kIdle): pass through the tile's stages.
  template <class Waited>
  __device__ static void skip(Pipeline& pipeline, State& read, int k_blocks, Waited&& waited) {
    if (k_blocks == 0) waited();
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb) {
      wait_slice(pipeline, read, kb, k_blocks, waited);
      release(pipeline, read);
      ++read;
    }
  }
};

// The kernel's mainloop as a type (kernels/sm90_gemm_kernel.cuh takes one): this one, for 16-bit
// operands in any layout; mainloop/sm90_tma_wgmma_fp8.cuh has the FP8 one.
struct TmaWgmmaMainloop {
  template <class T, class Tile, class Layout, bool kPairedB>
  using Apply = MainloopSm90TmaWgmma<T, Tile, Layout, kPairedB>;
};

}  // namespace jax_tma
