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
//      slice; a warpgroup reads the two of its thread's rows. With kAnyRow (tiles that may start
//      at any row: the ragged rows problem, whose groups start anywhere) the box starts at the
//      4-aligned row at or before the tile's first and brings Tile::kAScaleBoxAnyRow scales (the
//      16-byte rule below), and the consumers read them (first row) % 4 further in; the stage's
//      scales then take up to 128 bytes more (kExtraSmemBytes over the ring, for the kernel).
//   B: one 16-byte box from a map over [batch, K / 128, N / 128]: four column blocks' scales,
//      from the 4-aligned block at or before the tile's first (a tile spans 1 or 2 of them, or
//      half of one). NOTE: a TMA tile copy's innermost coordinate must fall on a 16-byte
//      boundary of the global tensor; a box starting at the tile's own block (4 bytes a block)
//      faulted with an illegal instruction on an H100. The consumer finds the tile's scales at
//      (first block) % 4 in the box.
//
// Promotion: a slice's partial sums are retired with wgmma.wait_group and added into the fp32
// accumulators times sa[row] * sb[column block]. The tensor core keeps about 14 bits of its FP8
// sums, so long contractions accumulated inside it lose accuracy; promoted every 128 K they
// lose none that fp32 keeps. The schedule follows the tile's width (kParts groups of kPartN
// columns per slice and warpgroup, kSets sets of partial-sum registers):
//   N <= 128 (kSets 2): slice kb + 1's group runs while slice kb is promoted (overlapped).
//   128 < N <= 192 (one group, kSets 1): the group retires before it is promoted, and the
//      other warpgroup's group keeps the tensor core busy meanwhile (cross, cuBLAS's schedule
//      for its promoting FP8 kernel). Its partial sums and the promoted ones take N registers
//      of the consumer's 232.
//   N = 256 (two groups of 128): as the cross schedule, a part at a time (in parts).
// A tile whose width neither divides nor is a multiple of 128 (144, 192) may span two of B's scale
// blocks (a width whose tiles can span three, such as 176, is rejected at compile time): its
// first `split` register quads (8 columns each) take the first block's scale, the rest the
// next one's; `split` is fixed per tile, and each value it can take for the width has its own
// unrolled promotion (promote_dispatch), so no select runs per register.
// kPromote = false accumulates the whole K range inside the tensor core instead (per-tensor
// scales only: the block scales are not read): one group of the tile's width per slice.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <numeric>
#include <utility>

#include "contract/sm90_gemm.h"
#include "mainloop/sm90_tma_wgmma.cuh"
#include "pipeline/tma_pipeline.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace jax_tma {

template <class TA, class TB, class Tile, class Layout, bool kPromote, bool kPairedB = false,
          bool kAnyRow = false>
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
  // NOTE: a promoted group spans at most 192 columns, so that its partial sums and the tile's
  // promoted sums fit a consumer's 232 registers together (128 x 256 tiles: two parts of 128,
  // 64 + 128 registers); 128 columns or fewer keep two sets of partial sums (3 x 64 registers).
  static constexpr int kPartN = !kPromote || kBlockN <= 192 ? kBlockN : 128;
  static constexpr int kParts = kBlockN / kPartN;
  static constexpr int kSets = kPromote && kBlockN <= 128 ? 2 : 1;
  static constexpr int kAccRegs = kBlockN / 2;
  static constexpr int kPartRegs = kPartN / 2;
  static constexpr int kPartQuads = kPartN / 8;  // register quads: 8 columns each
  // A warpgroup's 64 rows of the A stage, and B's rows of one part (K-major: 128 bytes a row).
  static constexpr int kAWarpgroupBytes = 64 * kBlockK;
  static constexpr int kBPartBytes = kPartN * kBlockK;
  using Mma = ptx::WgmmaFp8SS<kPartN, TA, TB>;

  static_assert(Tile::kElementBytes == 1 && sizeof(TA) == 1 && sizeof(TB) == 1, "FP8 operands");
  static_assert(!kPairedB, "gated products (two B maps) are 16-bit only");
  static_assert(Layout::kA == sm90_gemm::Major::kK && Layout::kB == sm90_gemm::Major::kK,
                "wgmma reads FP8 operands K-major only");
  static_assert(kBlockK == kScaleBlock, "one K slice per scale");
  static_assert(kBlockN % kPartN == 0 && (kParts == 1 || kPartN == kScaleBlock),
                "one part, or parts of one scale block each (256-wide tiles start at one)");

  // Column blocks of B's scales one part spans: where its width divides 128 (and tiles start at
  // multiples of it) one, else up to two.
  static constexpr int kGcdN = std::gcd(kPartN, kScaleBlock);
  static constexpr bool kTwoBlocks = kPromote && kParts == 1 && kScaleBlock % kPartN != 0;
  static constexpr int kScaleBlocks = kTwoBlocks ? 2 : kParts;
  // The splits a tile can have: tiles start at multiples of kPartN, so at offsets r (multiples
  // of kGcdN) into a scale block, and the first (128 - r) / 8 quads lie in that block.
  static constexpr int kSplitValues = kTwoBlocks ? kScaleBlock / kGcdN : 1;
  static_assert(!kTwoBlocks || kScaleBlock - kGcdN + kPartN <= 2 * kScaleBlock,
                "a tile spans at most two scale blocks");
  __host__ __device__ static constexpr int split_of(int i) {
    const int quads = (kScaleBlock - i * kGcdN) / 8;
    return quads < kPartQuads ? quads : kPartQuads;
  }

  // One stage's scales: A's box in a slot of whole 128-byte lines (TMA writes shared memory at
  // 128-byte aligned addresses), B's box in the first kBScaleBox floats of its 128-byte slot.
  static constexpr bool kAnyRowScales = kAnyRow;  // the consumers read the tile's first row
  static constexpr int kAScaleBox = kAnyRow ? Tile::kAScaleBoxAnyRow : kBlockM;
  static constexpr int kAScaleSlot = (kAScaleBox * 4 + 127) / 128 * 32;
  struct alignas(128) StageScales {
    float a[kAScaleSlot];
    float b[Tile::kBScaleSlotBytes / sizeof(float)];
  };
  // The consumer warpgroups of a cooperative tile run apart: one may skip() a tile whose rows
  // it does not reach while the other runs mma() on it.
  static constexpr bool kWarpgroupsIndependent = true;
  // The kernel's role branches warp-uniform, so that the cross schedule's per-slice descriptor
  // arithmetic runs on the uniform datapath (kernels/sm90_gemm_kernel.cuh). Not for the other
  // schedules: 128 x 256 tiles then spill (ptxas 13.0).
  static constexpr bool kUniformRole = kPromote && kParts == 1 && kSets == 1;
  struct SharedStorage {
    typename Operands::SharedStorage operands;
    StageScales scales[kStages];
  };
  // Shared memory the stages take beyond the tile's budget (contract/sm90_gemm.h counts kBlockM
  // of A's scales a stage), in whole KB (the kernel's staging follows the ring at a 1024-byte
  // boundary).
  static constexpr uint32_t kExtraScaleBytes = (kAScaleSlot - kBlockM) * sizeof(float);
  static constexpr uint32_t kExtraSmemBytes = (kStages * kExtraScaleBytes + 1023) / 1024 * 1024;
  static_assert(sizeof(StageScales) == Tile::kTileScaleBytes + kExtraScaleBytes);
  static_assert(kAnyRow || kExtraSmemBytes == 0);
  static constexpr uint32_t kAScaleBytes = kAScaleBox * sizeof(float);
  static constexpr uint32_t kBScaleBytes = Tile::kBScaleBox * sizeof(float);

  // The scales' tensor maps (kernel parameter), fp32, no swizzle, rank 3 {inner, K slice,
  // batch}: A's {M, K / 128, batch} with a box of {kBlockM, 1, 1}, B's {N / 128, K / 128,
  // batch} with a box of {kBScaleBox, 1, 1}. An operand without block scales (has_sa or has_sb
  // false) loads none and reads its per-tensor scale instead (tensor_sa, tensor_sb: one fp32
  // in global memory, read once per tile; promoted only, as the promotion multiplies anyway
  // and the epilogue is then spared a pass over the block), or 1 (no scale, or the epilogue's).
  struct Params {
    CUtensorMap sa;
    CUtensorMap sb;
    bool has_sa;
    bool has_sb;
    const float* tensor_sa;
    const float* tensor_sb;
  };

  // One thread, before the kernel's fence_mbarrier_init: barriers of the mainloop's own (none).
  __device__ static void init(SharedStorage&) {}

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
                          ptx::TmaCoord<3>{{a_scale_box_origin(plan.at.m0), kb,
                                            plan.at.batch_a}});
          }
          if (params.has_sb) {
            ptx::tma_load(scales.b, &params.sb, full,
                          ptx::TmaCoord<3>{{b_scale_box_origin(plan.at.n0), kb, plan.at.batch_b}});
          }
        });
  }

  // A's scale box: its first row (16-byte aligned with kAnyRow: see the header), and where in it
  // the scales of a tile starting at row `m0` begin.
  __device__ static int a_scale_box_origin(int m0) { return kAnyRow ? m0 & ~3 : m0; }
  __device__ static int a_scale_offset(int m0) { return kAnyRow ? m0 & 3 : 0; }
  // B's scale box: its first column block (16-byte aligned: see the header), and where in it
  // the scales of a tile starting at column `n0` begin.
  __device__ static int b_scale_box_origin(int n0) { return (n0 / kScaleBlock) & ~3; }
  __device__ static int b_scale_offset(int n0) { return (n0 / kScaleBlock) & 3; }
  static_assert(Tile::kBScaleBox >= 4 + kScaleBlocks - 1,
                "a tile's scale blocks lie in one aligned box");

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

  // Consumer warpgroup: A's row block `a_block` of the output tile at `at` (its first row and
  // column in the operands' coordinates) over
  // `k_blocks` (>= 1) slices into `acc`. `waited()` runs once the tile's last stage is known
  // full; `midway(k_blocks)` (the epilogue's prefetch hook, MainloopSm90TmaWgmma::mma) once, at
  // the end: the fp8 epilogues read no operand.
  template <class Waited, class Midway>
  __device__ static void mma(Pipeline& pipeline, State& read, SharedStorage& smem,
                             int a_block, const TileOrigin& at, int k_blocks,
                             float (&acc)[kAccRegs],
                             Waited&& waited, Midway&& midway, const Params& params) {
    if constexpr (kPromote) {
      promoted(pipeline, read, smem, a_block, at.m0, at.n0, k_blocks, acc, waited, params);
    } else {
      unpromoted(pipeline, read, smem, a_block, k_blocks, acc, waited);
    }
    midway(k_blocks);
  }

  // Where this thread reads a slice's scales: the shared addresses, in stage 0, of its first
  // row's A scale (the second row's is 8 floats on) and of the tile's first block in B's box
  // (a stage's are sizeof(StageScales) further per stage), which operands have block scales,
  // and the scale of those that have not. The addresses are made once per tile: rebuilt from
  // threadIdx per slice (ptxas's choice at 232 registers), they put ~18 integer instructions
  // before each slice's issue, and block scales on A ran 5-7 % behind per-tensor ones
  // (docs/notebook/2026-11-30-ep-slices-and-fp8-scales.md).
  struct SliceReads {
    uint32_t a_addr, b_addr;
    bool has_sa, has_sb;
    float tensor_sa, tensor_sb;
  };
  // One K slice's scales for this thread: A's of its two rows, B's of each block the tile spans.
  struct SliceScales {
    float a0, a1;
    float b[kScaleBlocks];
  };
  __device__ static SliceScales slice_scales(int stage, const SliceReads& at) {
    const uint32_t step = stage * static_cast<uint32_t>(sizeof(StageScales));
    SliceScales s;
    s.a0 = at.has_sa ? ptx::ld_shared_f32(at.a_addr + step) : at.tensor_sa;
    s.a1 = at.has_sa ? ptx::ld_shared_f32(at.a_addr + step + 8 * sizeof(float)) : at.tensor_sa;
#pragma unroll
    for (int i = 0; i < kScaleBlocks; ++i) {
      s.b[i] = at.has_sb ? ptx::ld_shared_f32(at.b_addr + step + i * sizeof(float))
                         : at.tensor_sb;
    }
    return s;
  }

  // acc[part p] += d * (row scale x column-block scale): quads [0, kSplit) of the part with
  // block b0's scale, the rest with block b0 + 1's.
  template <int kSplit>
  __device__ static void promote(float (&acc)[kAccRegs], int p, const float (&d)[kPartRegs],
                                 const SliceScales& s) {
    const int b0 = kTwoBlocks ? 0 : p;
    const float lo0 = s.a0 * s.b[b0], lo1 = s.a1 * s.b[b0];
    const float hi0 = kSplit < kPartQuads ? s.a0 * s.b[b0 + 1] : lo0;
    const float hi1 = kSplit < kPartQuads ? s.a1 * s.b[b0 + 1] : lo1;
#pragma unroll
    for (int j = 0; j < kPartQuads; ++j) {
      const float s0 = j < kSplit ? lo0 : hi0, s1 = j < kSplit ? lo1 : hi1;
      float* out = acc + p * kPartRegs + 4 * j;
      out[0] += d[4 * j] * s0;
      out[1] += d[4 * j + 1] * s0;
      out[2] += d[4 * j + 2] * s1;
      out[3] += d[4 * j + 3] * s1;
    }
  }
  // promote<split>, for the tile's split (one of split_of(0 .. kSplitValues - 1)).
  template <int... kI>
  __device__ static void promote_dispatch(std::integer_sequence<int, kI...>, int split,
                                          float (&acc)[kAccRegs], int p,
                                          const float (&d)[kPartRegs], const SliceScales& s) {
    (void)((split == split_of(kI) && (promote<split_of(kI)>(acc, p, d, s), true)) || ...);
  }
  __device__ static void promote(float (&acc)[kAccRegs], int p, const float (&d)[kPartRegs],
                                 const SliceScales& s, int split) {
    if constexpr (kSplitValues == 1) {
      promote<kPartQuads>(acc, p, d, s);
    } else {
      promote_dispatch(std::make_integer_sequence<int, kSplitValues>{}, split, acc, p, d, s);
    }
  }

  template <class Waited>
  __device__ static void promoted(Pipeline& pipeline, State& read, SharedStorage& smem,
                                  int a_block, int m0, int n0, int k_blocks,
                                  float (&acc)[kAccRegs],
                                  Waited&& waited, const Params& params) {
    // This thread's rows of the warpgroup's 64 (accumulator layout: ptx/wgmma.cuh): r, r + 8.
    const int row = a_scale_offset(m0) + a_block * 64 + 16 * ((threadIdx.x / 32) % 4) +
                    (threadIdx.x % 32) / 4;
    // A's address through an identity shuffle: ptxas cannot rebuild it from threadIdx then,
    // and keeps it in a register instead.
    const SliceReads at{__shfl_sync(0xffffffffu, ptx::smem_u32(smem.scales[0].a + row),
                                    threadIdx.x % 32),
                        ptx::smem_u32(smem.scales[0].b + b_scale_offset(n0)),
                        params.has_sa, params.has_sb,
                        params.tensor_sa != nullptr ? __ldg(params.tensor_sa) : 1.0f,
                        params.tensor_sb != nullptr ? __ldg(params.tensor_sb) : 1.0f};
    // Quads of the tile in its first scale block (all of them where it lies in one).
    const int split = min(kPartQuads, (kScaleBlock - n0 % kScaleBlock) / 8);
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.0f;
    if constexpr (kSets == 2) {
      promoted_overlapped(pipeline, read, smem, a_block, at, split, k_blocks, acc, waited);
    } else if constexpr (kParts == 1) {
      promoted_cross(pipeline, read, smem, a_block, at, split, k_blocks, acc, waited);
    } else {
      promoted_in_parts(pipeline, read, smem, a_block, at, split, k_blocks, acc, waited);
    }
  }

  // Tiles of one column part (N <= 128: up to 64 registers of partial sums): two sets of partial
  // sums, so that slice kb + 1's wgmma group runs while slice kb is promoted; the tensor core
  // always has a group queued, as in the unpromoted schedule (one set, which waits for every
  // group to retire before the next is issued, measured far slower:
  // docs/notebook/2026-11-29-tile-registry-figures.md). The loop is unrolled by two so that
  // each set is a fixed register array.
  template <class Waited>
  __device__ static void promoted_overlapped(Pipeline& pipeline, State& read,
                                             const SharedStorage& smem, int a_block,
                                             const SliceReads& at, int split, int k_blocks,
                                             float (&acc)[kAccRegs], Waited&& waited) {
    float d0[kPartRegs], d1[kPartRegs];
    SliceScales s0, s1;
    // Waits for slice kb's stage and issues its group into `d` (reading its scales into `s`).
    const auto start = [&](float (&d)[kPartRegs], SliceScales& s, int kb) {
      Operands::wait_slice(pipeline, read, kb, k_blocks, waited);
      s = slice_scales(read.index, at);
      ptx::wgmma_fence();
      issue(smem, read.index, a_block, 0, d, false);
      ptx::wgmma_commit_group();
      ++read;
    };
    // Retires the oldest group (`d`): its stage goes back to the producer (the group still in
    // flight, if `more`, reads the next one) and its sums are promoted.
    State oldest = read;
    const auto finish = [&](float (&d)[kPartRegs], SliceScales& s, bool more) {
      if (more) {
        ptx::wgmma_wait_group<1>();
      } else {
        ptx::wgmma_wait_group<0>();
      }
      ptx::wgmma_fence_operands(d);
      Operands::release(pipeline, oldest);
      ++oldest;
      promote(acc, 0, d, s, split);
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

  // Descriptors of the cross schedule, built once per tile: the low word (start address / 16)
  // of stage 0's rows, made warp-uniform (lane 0's) so that per slice only a uniform add runs;
  // the high word (8-row groups 1024 bytes apart, 128-byte swizzle) is a constant.
  static constexpr uint64_t kDescHigh = ptx::smem_desc_layout(0, 1024, ptx::WgmmaSwizzle::k128B);
  static constexpr uint32_t kAStageUnits = Tile::kTileABytes / 16;
  static constexpr uint32_t kBStageUnits = Tile::kTileBBytes / 16;
  __device__ static uint32_t desc_low(const uint8_t* tile) {
    return __shfl_sync(0xffffffffu, ptx::smem_desc_address(tile), 0);
  }

  // Tiles of one group of up to 192 columns (cuBLAS's promoting FP8 kernel has this shape: one
  // group of 64 x 144 per warpgroup and slice, retired before it is promoted). Per slice: look
  // whether the next stage is full (consumer_probe) while the group in flight runs, retire that
  // group, release its stage, promote it, wait for the next stage only if the look found it
  // empty, read its scales, issue its group. What lies between a group's retirement and the
  // next issue is what the other warpgroup's group must cover for the tensor core to stay
  // busy. NOTE: waiting for the next stage before the retire (a blocking wait there) held each
  // stage's release and promotion back until the next stage arrived: under ncu (8192^3, H200)
  // that wait took 17 % of the consumers' stall samples against 2 % for cuBLAS's probe.
  template <class Waited>
  __device__ static void promoted_cross(Pipeline& pipeline, State& read, SharedStorage& smem,
                                        int a_block, const SliceReads& at, int split,
                                        int k_blocks, float (&acc)[kAccRegs], Waited&& waited) {
    const uint32_t a_low = desc_low(smem.operands.a[0] + a_block * kAWarpgroupBytes);
    const uint32_t b_low = desc_low(smem.operands.b[0]);
    float d[kPartRegs];
    const auto issue_slice = [&](int stage) {
      const uint32_t a = a_low + stage * kAStageUnits, b = b_low + stage * kBStageUnits;
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / kWgmmaK; ++kk) {
        Mma::mma(d, kDescHigh | (a + kk * (kWgmmaK / 16)), kDescHigh | (b + kk * (kWgmmaK / 16)),
                 kk > 0 ? 1 : 0);
      }
      ptx::wgmma_commit_group();
    };
    Operands::wait_slice(pipeline, read, 0, k_blocks, waited);
    SliceScales s = slice_scales(read.index, at);
    issue_slice(read.index);
    State in_flight = read;
    ++read;
#pragma unroll 1
    for (int kb = 1; kb < k_blocks; ++kb) {
      const bool full = pipeline.consumer_probe(read);
      ptx::wgmma_wait_group<0>();
      ptx::wgmma_fence_operands(d);
      Operands::release(pipeline, in_flight);
      promote(acc, 0, d, s, split);
      Operands::wait_slice(pipeline, read, kb, k_blocks, waited, full);
      s = slice_scales(read.index, at);
      issue_slice(read.index);
      in_flight = read;
      ++read;
    }
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(d);
    Operands::release(pipeline, in_flight);
    promote(acc, 0, d, s, split);
  }

  // 256-wide tiles (two groups of 128: the partial sums of one and the promoted ones leave room
  // for no more): each group retires before it is promoted, a part at a time; the other
  // consumer warpgroup's groups keep the tensor core busy meanwhile. The consumers issue freely:
  // taking turns ran slower (docs/fp8.md).
  template <class Waited>
  __device__ static void promoted_in_parts(Pipeline& pipeline, State& read, SharedStorage& smem,
                                           int a_block, const SliceReads& at, int split,
                                           int k_blocks, float (&acc)[kAccRegs],
                                           Waited&& waited) {
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb) {
      Operands::wait_slice(pipeline, read, kb, k_blocks, waited);
      const SliceScales s = slice_scales(read.index, at);
#pragma unroll
      for (int p = 0; p < kParts; ++p) {
        float d[kPartRegs];
        ptx::wgmma_fence();
        issue(smem, read.index, a_block, p, d, false);
        ptx::wgmma_commit_group();
        ptx::wgmma_wait_group<0>();
        ptx::wgmma_fence_operands(d);
        if (p == kParts - 1) Operands::release(pipeline, read);
        promote(acc, p, d, s, split);
      }
      ++read;
    }
  }

  // The 16-bit mainloop's schedule: one wgmma group of the tile's width in flight, each stage
  // released as soon as the group reading it has retired.
  template <class Waited>
  __device__ static void unpromoted(Pipeline& pipeline, State& read, const SharedStorage& smem,
                                    int a_block, int k_blocks, float (&acc)[kAccRegs],
                                    Waited&& waited) {
    ptx::wgmma_fence_operands(acc);
    State in_flight = read;
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb) {
      Operands::wait_slice(pipeline, read, kb, k_blocks, waited);
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
// the kernel's input type, B's is TB; kAnyRow for problems whose tiles may start at any row.
template <class TB, bool kPromote = true, bool kAnyRow = false>
struct Fp8Mainloop {
  template <class TA, class Tile, class Layout, bool kPairedB>
  using Apply = MainloopSm90Fp8<TA, TB, Tile, Layout, kPromote, kPairedB, kAnyRow>;
};

}  // namespace jax_tma
