// Mainloop of the sm90 FP8 GEMM: TMA fills a ring of (A, B, scales) stages, the consumer
// warpgroups run e4m3/e5m2 wgmma (m64nNk32) on them and promote the tensor core's partial sums
// to fp32 registers once per K slice of 128, scaled on the way.
//
// Operands are K-major only (wgmma reads 8-bit operands in no other layout): A [M, K], B [N, K],
// both 128-byte swizzled, one 128-byte row per M or N index and K slice. The copies of A and B
// and the ring are the 16-bit mainloop's (MainloopSm90TmaWgmma on 1-byte elements: same boxes,
// same multicast of B across a cluster, same boxes past the matrix left out). Each stage also
// receives its K slice's scales, by TMA, on the stage's full barrier:
//   A: kBlockM fp32 from a map over [batch, K / 128, M] (M contiguous): row m's scale of the
//      slice; a warpgroup reads the two of its thread's rows.
//   B: one 16-byte box from a map over [batch, K / 128, N / 128]: four column blocks' scales,
//      from the 4-aligned block at or before the tile's first (a tile spans 1 or 2 of them, or
//      half of one). NOTE: a TMA tile copy's innermost coordinate must fall on a 16-byte
//      boundary of the global tensor; a box starting at the tile's own block (4 bytes a block)
//      faulted with an illegal instruction on an H100. The consumer finds the tile's scales at
//      (first block) % 4 in the box.
//
// Promotion: a slice's partial sums (one wgmma group per 128 columns: kPartRegs registers,
// reused) are retired with wgmma.wait_group 0 and added into the fp32 accumulators times
// sa[row] * sb[column block]. The tensor core keeps about 14 bits of its FP8 sums, so long
// contractions accumulated inside it lose accuracy; promoted every 128 K they lose none that
// fp32 keeps. While one warpgroup promotes, the other's wgmma runs. kPromote = false
// accumulates the whole K range inside the tensor core instead (per-tensor scales only: the
// block scales are not read), kept to measure that loss.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "contract/sm90_gemm.h"
#include "mainloop/sm90_tma_wgmma.cuh"
#include "pipeline/ordered_barrier.cuh"
#include "pipeline/tma_pipeline.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace jax_tma {

template <class TA, class TB, class Tile, class Layout, bool kPromote, bool kPairedB = false>
struct MainloopSm90Fp8 {
  // A and B as bytes: the copies do not depend on the FP8 format, only wgmma does.
  using Operands = MainloopSm90TmaWgmma<uint8_t, Tile, Layout>;
  using Pipeline = typename Operands::Pipeline;
  using State = typename Operands::State;
  using Boxes = typename Operands::Boxes;

  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kBlockK = Tile::kBlockK;
  static constexpr int kStages = Tile::kStages;
  static constexpr int kWgmmaK = 32;
  static constexpr int kScaleBlock = 128;  // K and N indices per scale
  static constexpr int kMidwaySlice = Operands::kMidwaySlice;  // (the hook runs at the end)
  // NOTE: one wgmma group spans at most 128 columns, so that its partial sums and the tile's
  // promoted sums fit a consumer's 232 registers together (128 x 256 tiles: 64 + 128).
  static constexpr int kPartN = kBlockN < 128 ? kBlockN : 128;
  static constexpr int kParts = kBlockN / kPartN;
  static constexpr int kAccRegs = kBlockN / 2;
  static constexpr int kPartRegs = kPartN / 2;
  // A warpgroup's 64 rows of the A stage, and B's rows of one part (K-major: 128 bytes a row).
  static constexpr int kAWarpgroupBytes = 64 * kBlockK;
  static constexpr int kBPartBytes = kPartN * kBlockK;
  using Mma = ptx::WgmmaFp8SS<kPartN, TA, TB>;

  static_assert(Tile::kElementBytes == 1 && sizeof(TA) == 1 && sizeof(TB) == 1, "FP8 operands");
  static_assert(!kPairedB, "gated products (two B maps) are 16-bit only");
  static_assert(Layout::kA == sm90_gemm::Major::kK && Layout::kB == sm90_gemm::Major::kK,
                "wgmma reads FP8 operands K-major only");
  static_assert(kBlockK == kScaleBlock, "one K slice per scale");
  static_assert(kBlockN == 64 || kBlockN % kScaleBlock == 0,
                "every part's columns lie in one of B's scale blocks");
  static_assert(kParts <= Tile::kBScaleBox, "one scale box spans the tile's column blocks");

  // One stage's scales; B's box fills the first kBScaleBox floats of its 128-byte slot.
  struct alignas(128) StageScales {
    float a[kBlockM];
    float b[Tile::kBScaleSlotBytes / sizeof(float)];
  };
  // Cooperative tiles of two column parts: the consumers take turns at issuing a part's group
  // (see promoted_in_parts; ping-pong consumers work on different tiles and need none).
  static constexpr bool kIssueTurns = kParts > 1 && !Tile::kPingPong;
  using IssueTurns = OrderedBarrier<2, 1>;
  // Consumers that take issue turns wait on each other: neither may skip a tile alone.
  static constexpr bool kWarpgroupsIndependent = !kIssueTurns;
  struct SharedStorage {
    typename Operands::SharedStorage operands;
    StageScales scales[kStages];
    typename IssueTurns::SharedStorage issue_turns;
  };
  static_assert(sizeof(StageScales) == Tile::kTileScaleBytes);
  static constexpr uint32_t kAScaleBytes = kBlockM * sizeof(float);
  static constexpr uint32_t kBScaleBytes = Tile::kBScaleBox * sizeof(float);

  // The scales' tensor maps (kernel parameter), fp32, no swizzle, rank 3 {inner, K slice,
  // batch}: A's {M, K / 128, batch} with a box of {kBlockM, 1, 1}, B's {N / 128, K / 128,
  // batch} with a box of {kBScaleBox, 1, 1}. An operand without block scales (has_sa or has_sb
  // false: its scales, if any, are the epilogue's) loads none and reads 1.
  struct Params {
    CUtensorMap sa;
    CUtensorMap sb;
    bool has_sa;
    bool has_sb;
  };

  // One thread, before the kernel's fence_mbarrier_init: the issue turns' barriers (every
  // thread of a warpgroup arrives when it leaves its turn).
  __device__ static void init(SharedStorage& smem) {
    if constexpr (kIssueTurns) IssueTurns::init(smem.issue_turns, 128);
  }

  // One thread, at the kernel's start: the scales' maps into the descriptor cache.
  __device__ static void prefetch(const Params& params) {
    if (params.has_sa) ptx::prefetch_tensormap(&params.sa);
    if (params.has_sb) ptx::prefetch_tensormap(&params.sb);
  }

  // Producer (one thread): stream K slices [kb_begin, kb_end) of one output tile, with their
  // scales, into the ring (see MainloopSm90TmaWgmma::load).
  __device__ static void load(Pipeline& pipeline, State& write, SharedStorage& smem,
                              const LoadPlan& plan, int kb_begin, int kb_end, LoadMode mode,
                              int rank, uint32_t a_stage_bytes, const Params& params) {
    const int a_loads = Operands::a_loads(plan);
    const int b_loads = Operands::b_loads(plan);
    const uint32_t bytes = Operands::stage_bytes(a_loads, b_loads, a_stage_bytes) +
                           (params.has_sa ? kAScaleBytes : 0) + (params.has_sb ? kBScaleBytes : 0);
    Operands::fill_stages(
        pipeline, write, plan, kb_begin, kb_end, mode, bytes,
        [&](int stage, int kb, uint64_t* full) {
          Operands::copy_stage(smem.operands, stage, plan, a_loads, b_loads, kb, mode, rank,
                               full);
          StageScales& scales = smem.scales[stage];
          if (params.has_sa) {
            ptx::tma_load(scales.a, &params.sa, full,
                          ptx::TmaCoord<3>{{plan.at.m0, kb, plan.at.batch_a}});
          }
          if (params.has_sb) {
            ptx::tma_load(scales.b, &params.sb, full,
                          ptx::TmaCoord<3>{{b_scale_box_origin(plan.at.n0), kb, plan.at.batch_b}});
          }
        });
  }

  // B's scale box: its first column block (16-byte aligned: see the header), and where in it
  // the scales of a tile starting at column `n0` begin.
  __device__ static int b_scale_box_origin(int n0) { return (n0 / kScaleBlock) & ~3; }
  __device__ static int b_scale_offset(int n0) { return (n0 / kScaleBlock) & 3; }
  static_assert(Tile::kBScaleBox == 4 && (kParts == 1 || kBlockN == 2 * kScaleBlock),
                "a tile's scale blocks lie in one aligned box (a 256-wide tile starts at an even "
                "block)");

  // Descriptors of k32 step `kk` of K-major tiles: 32 bytes along the swizzled rows.
  __device__ static uint64_t desc(const uint8_t* tile, int kk) {
    return ptx::make_smem_desc(tile + kk * kWgmmaK, 0, 1024, ptx::WgmmaSwizzle::k128B);
  }

  // Column part `p` of one K slice: four k32 steps on stage `stage` into `d`.
  __device__ static void issue(const SharedStorage& smem, int stage, int a_block, int p,
                               float (&d)[kPartRegs], bool accumulate) {
    const uint8_t* a = smem.operands.a[stage] + a_block * kAWarpgroupBytes;
    const uint8_t* b = smem.operands.b[stage] + p * kBPartBytes;
#pragma unroll
    for (int kk = 0; kk < kBlockK / kWgmmaK; ++kk) {
      Mma::mma(d, desc(a, kk), desc(b, kk), (accumulate || kk > 0) ? 1 : 0);
    }
  }

  // Part `p` of the accumulators, as wgmma's operand.
  __device__ static float (&part(float (&acc)[kAccRegs], int p))[kPartRegs] {
    return *reinterpret_cast<float(*)[kPartRegs]>(acc + p * kPartRegs);
  }

  // Consumer warpgroup: A's row block `a_block` of the output tile at column `n0` over
  // `k_blocks` (>= 1) slices into `acc`. `waited()` runs once the tile's last stage is known
  // full; `midway(k_blocks)` (the epilogue's prefetch hook, MainloopSm90TmaWgmma::mma) once, at
  // the end: the fp8 epilogues read no operand.
  template <class Waited, class Midway>
  __device__ static void mma(Pipeline& pipeline, State& read, SharedStorage& smem,
                             int a_block, int n0, int k_blocks, float (&acc)[kAccRegs],
                             Waited&& waited, Midway&& midway, const Params& params) {
    if constexpr (kPromote) {
      promoted(pipeline, read, smem, a_block, n0, k_blocks, acc, waited, params);
    } else {
      unpromoted(pipeline, read, smem, a_block, k_blocks, acc, waited);
    }
    midway(k_blocks);
  }

  // Where this thread reads a slice's scales: its first row of A's (the second is row + 8),
  // the tile's first block in B's box, and which operands have block scales.
  struct SliceReads {
    int row, sb0;
    bool has_sa, has_sb;
  };
  // One K slice's scales for this thread: A's of its two rows, B's of each column part.
  struct SliceScales {
    float a0, a1;
    float b[kParts];
  };
  __device__ static SliceScales slice_scales(const StageScales& scales, const SliceReads& at) {
    SliceScales s;
    s.a0 = at.has_sa ? ptx::ld_shared_f32(ptx::smem_u32(scales.a + at.row)) : 1.0f;
    s.a1 = at.has_sa ? ptx::ld_shared_f32(ptx::smem_u32(scales.a + at.row + 8)) : 1.0f;
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      s.b[p] = at.has_sb ? ptx::ld_shared_f32(ptx::smem_u32(scales.b + at.sb0 + p)) : 1.0f;
    }
    return s;
  }

  // acc[part p] += d * (row scale x column-block scale).
  __device__ static void promote(float (&acc)[kAccRegs], int p, const float (&d)[kPartRegs],
                                 const SliceScales& s) {
    const float s0 = s.a0 * s.b[p];
    const float s1 = s.a1 * s.b[p];
#pragma unroll
    for (int j = 0; j < kPartRegs / 4; ++j) {
      float* out = acc + p * kPartRegs + 4 * j;
      out[0] += d[4 * j] * s0;
      out[1] += d[4 * j + 1] * s0;
      out[2] += d[4 * j + 2] * s1;
      out[3] += d[4 * j + 3] * s1;
    }
  }

  template <class Waited>
  __device__ static void promoted(Pipeline& pipeline, State& read, SharedStorage& smem,
                                  int a_block, int n0, int k_blocks, float (&acc)[kAccRegs],
                                  Waited&& waited, const Params& params) {
    // This thread's rows of the warpgroup's 64 (accumulator layout: ptx/wgmma.cuh): r, r + 8.
    const int row = a_block * 64 + 16 * ((threadIdx.x / 32) % 4) + (threadIdx.x % 32) / 4;
    const SliceReads at{row, b_scale_offset(n0), params.has_sa, params.has_sb};
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.0f;
    if constexpr (kParts == 1) {
      promoted_overlapped(pipeline, read, smem, a_block, at, k_blocks, acc, waited);
    } else {
      promoted_in_parts(pipeline, read, smem, a_block, at, k_blocks, acc, waited);
    }
  }

  // Tiles of one column part (N <= 128: 64 registers of partial sums): two sets of partial
  // sums, so that slice kb + 1's wgmma group runs while slice kb is promoted; the tensor core
  // always has a group queued, as in the unpromoted schedule. (Measured on an H100, 8192^3
  // block-scaled on 128 x 128 tiles: 1008 TFLOP/s with one set, which waits for every group
  // to retire before the next is issued; 1386 without promotion.) The loop is unrolled by two
  // so that each set is a fixed register array.
  template <class Waited>
  __device__ static void promoted_overlapped(Pipeline& pipeline, State& read,
                                             const SharedStorage& smem, int a_block,
                                             const SliceReads& at, int k_blocks,
                                             float (&acc)[kAccRegs], Waited&& waited) {
    float d0[kPartRegs], d1[kPartRegs];
    SliceScales s0, s1;
    // Waits for slice kb's stage, reads its scales and issues its group into `d`.
    const auto start = [&](float (&d)[kPartRegs], SliceScales& s, int kb) {
      pipeline.consumer_wait(read);
      if (kb == k_blocks - 1) waited();
      s = slice_scales(smem.scales[read.index], at);
      ptx::wgmma_fence();
      issue(smem, read.index, a_block, 0, d, false);
      ptx::wgmma_commit_group();
      ++read;
    };
    // Retires the oldest group (`d`): its stage goes back to the producer (the group still in
    // flight, if `more`, reads the next one) and its sums are promoted.
    State oldest = read;
    const auto finish = [&](float (&d)[kPartRegs], const SliceScales& s, bool more) {
      if (more) {
        ptx::wgmma_wait_group<1>();
      } else {
        ptx::wgmma_wait_group<0>();
      }
      ptx::wgmma_fence_operands(d);
      Operands::release(pipeline, oldest);
      ++oldest;
      promote(acc, 0, d, s);
    };
    // NOTE: no group is issued on a data-dependent branch inside the loop: ptxas then
    // serialises every wgmma of the function (C7518). The pairs run unconditionally; one or
    // two slices are left for after the loop.
    start(d0, s0, 0);
    int kb = 0;
#pragma unroll 1
    for (; kb + 2 < k_blocks; kb += 2) {
      start(d1, s1, kb + 1);  // d0 holds slice kb
      finish(d0, s0, true);
      start(d0, s0, kb + 2);  // d1 holds slice kb + 1
      finish(d1, s1, true);
    }
    if (kb + 1 < k_blocks) {
      start(d1, s1, kb + 1);
      finish(d0, s0, true);
      finish(d1, s1, false);
    } else {
      finish(d0, s0, false);
    }
  }

  // Tiles of two column parts (128 x 256: 128 promoted registers leave room for one part's
  // 64 partial sums only): each part's group retires before the next is issued; the other
  // consumer warpgroup's groups keep the tensor core busy meanwhile.
  // NOTE: the cooperative consumers take turns at issuing their parts' groups (IssueTurns:
  // warpgroup 0's part, then 1's, then 0's next ...). Issued freely, both warpgroups met each
  // stage's full barrier together and interleaved their groups' wgmma, so both groups retired
  // at about the same time and both promoted while the tensor core had nothing queued. In
  // turns, one warpgroup's group runs while the other promotes. 8192^3 per-tensor on an H100,
  // same run: 1199 -> 1228 TFLOP/s (4096 x 7168 x 16384: 1216 -> 1254); block-scaled unchanged
  // (1187 -> 1183, 1202 -> 1200).
  template <class Waited>
  __device__ static void promoted_in_parts(Pipeline& pipeline, State& read, SharedStorage& smem,
                                           int a_block, const SliceReads& at, int k_blocks,
                                           float (&acc)[kAccRegs], Waited&& waited) {
    // A tile takes an even number of turns, so each tile starts at the barriers' first phase.
    static_assert(kParts % 2 == 0);
    IssueTurns turns{smem.issue_turns, static_cast<uint32_t>(a_block)};
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb) {
      pipeline.consumer_wait(read);
      if (kb == k_blocks - 1) waited();
      const SliceScales s = slice_scales(smem.scales[read.index], at);
#pragma unroll
      for (int p = 0; p < kParts; ++p) {
        float d[kPartRegs];
        if constexpr (kIssueTurns) turns.wait();
        ptx::wgmma_fence();
        issue(smem, read.index, a_block, p, d, false);
        ptx::wgmma_commit_group();
        if constexpr (kIssueTurns) turns.arrive();
        ptx::wgmma_wait_group<0>();
        ptx::wgmma_fence_operands(d);
        if (p == kParts - 1) Operands::release(pipeline, read);
        promote(acc, p, d, s);
      }
      ++read;
    }
  }

  // The 16-bit mainloop's schedule: one wgmma group in flight, each stage released as soon as
  // the group reading it has retired.
  template <class Waited>
  __device__ static void unpromoted(Pipeline& pipeline, State& read, const SharedStorage& smem,
                                    int a_block, int k_blocks, float (&acc)[kAccRegs],
                                    Waited&& waited) {
    ptx::wgmma_fence_operands(acc);
    State in_flight = read;
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb) {
      pipeline.consumer_wait(read);
      if (kb == k_blocks - 1) waited();
      ptx::wgmma_fence();
#pragma unroll
      for (int p = 0; p < kParts; ++p) issue(smem, read.index, a_block, p, part(acc, p), kb > 0);
      ptx::wgmma_commit_group();
      if (kb > 0) {
        ptx::wgmma_wait_group<1>();
        Operands::release(pipeline, in_flight);
      }
      in_flight = read;
      ++read;
    }
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(acc);
    Operands::release(pipeline, in_flight);
  }

  // Consumer warpgroup of an idle CTA (LoadMode::kIdle): pass through the tile's stages.
  template <class Waited>
  __device__ static void skip(Pipeline& pipeline, State& read, int k_blocks, Waited&& waited) {
    Operands::skip(pipeline, read, k_blocks, waited);
  }
};

// The FP8 mainloop as the kernel's mainloop type (kernels/sm90_gemm_kernel.cuh): A's FP8 type is
// the kernel's input type, B's is TB.
template <class TB, bool kPromote = true>
struct Fp8Mainloop {
  template <class TA, class Tile, class Layout, bool kPairedB>
  using Apply = MainloopSm90Fp8<TA, TB, Tile, Layout, kPromote, kPairedB>;
};

}  // namespace jax_tma
