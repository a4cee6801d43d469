// Host-visible contract of the sm90 GEMM kernel: tile configurations, operand layouts, their
// shared-memory budgets and TMA box shapes, and the launch entry points. Included by the FFI
// handler and by the kernel, so host and device read every size from the same constexpr.
//
// Batched, strided: for b in [0, batch), D[b] = A[b] @ B[b]. A is K-major (A[b] stored M x K,
// K contiguous) or M-major (stored K x M); B is N-major (stored K x N) or K-major (stored
// N x K). An operand with batch stride 0 is the same matrix for every b. D is
// [splits, batch, M, N] with free strides on all but N (splits = 1: the product itself;
// split-K: one fp32 partial product per K range, summed by the caller). Inputs bf16 or fp16,
// accumulation fp32, output the input type or fp32. The tiles and boxes are generic over the
// element size: the FP8 products (contract/sm90_fp8.h) use the same contract with 1-byte
// elements, K-major operands and 128-wide K slices.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_tma::sm90_gemm {

// FP8 types are operands of the FP8 products only (contract/sm90_fp8.h).
enum class DType : int { kBF16 = 0, kF16 = 1, kF32 = 2, kF8E4M3 = 3, kF8E5M2 = 4 };

inline constexpr int dtype_bytes(DType t) {
  return t == DType::kF32 ? 4 : (t == DType::kF8E4M3 || t == DType::kF8E5M2) ? 1 : 2;
}

// How the consumers write D: through shared memory and TMA stores (needs 16-byte aligned rows
// of D), or straight from registers with bounds checks (any N).
enum class EpilogueKind : int { kTmaStore = 0, kDirect = 1 };

// One compiled CTA tile configuration: one producer warpgroup issues the copies, two consumer
// warpgroups run wgmma and the epilogue, 64 rows of a tile each. A 128-row tile is cooperative:
// the two consumers split its rows. A 64-row tile is ping-pong: each consumer computes whole
// tiles, the two taking alternate ones, so one's epilogue runs under the other's mainloop.
// With kClusterM = 2, the two CTAs of a cluster take vertically adjacent tiles and multicast the
// shared B slice to both, CTA r issuing B's 64-wide column blocks j with j % 2 == r (for 192
// columns: blocks 0 and 2, and block 1). kBlockN need not be a multiple of 64 (232): B's
// last block is loaded whole.
// Elements are 2 bytes (bf16, fp16) or 1 byte (FP8): a K slice is one 128-byte swizzle row
// either way (64 or 128 K indices), so every box, stage and byte count below is the same in
// bytes. A 1-byte stage also carries its K slice's scales (kTileScaleBytes: one fp32 per A row,
// and one 32-byte box of B's; mainloop/sm90_tma_wgmma_fp8.cuh).
template <int kBlockM_, int kBlockN_, int kStages_, int kClusterM_, EpilogueKind kEpilogue_,
          int kEpilogueBuffers_ = (kBlockN_ + 63) / 64, int kElementBytes_ = 2>
struct TileConfig {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kElementBytes = kElementBytes_;
  static constexpr int kBlockK = 128 / kElementBytes;  // one 128-byte swizzle row
  static constexpr int kStages = kStages_;
  static constexpr int kClusterM = kClusterM_;
  static constexpr EpilogueKind kEpilogue = kEpilogue_;
  static constexpr bool kPingPong = kBlockM == 64;
  // Stream-K (scheduler/tile_scheduler.cuh) needs cooperative tiles without clusters.
  static constexpr bool kStreamK = !kPingPong && kClusterM_ == 1;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // Consumer warps that read (and release) each stage: one warpgroup's in ping-pong.
  static constexpr int kStageReaderWarps = kPingPong ? 4 : 4 * kConsumerWarpgroups;
  // Elements in one 128-byte swizzle row: the inner extent of every operand box.
  static constexpr int kSwizzleElems = 128 / kElementBytes;
  // B arrives in kBColumnBlocks blocks of kBBlockN N indices (the unit the cluster splits): 64,
  // whatever its layout. A 16-bit tile whose width is not a multiple of 64 loads its last block
  // whole: wgmma reads only the tile's columns of it, and the rest (the next tile's, or TMA's
  // zero fill) goes unused. FP8 tiles (B K-major, one 128-byte row per N index) split such a
  // width into equal blocks instead (128 x 144: three of 48), so that a stage holds no column
  // the tile does not read. Blocks wholly past the matrix's last column are not loaded at all:
  // TMA zero-fills a whole box slowly (MainloopSm90TmaWgmma::boxes_within).
  static constexpr int kBColumnBlocks = (kBlockN + 63) / 64;
  static constexpr int kBBlockN =
      kElementBytes == 1 && kBlockN % (8 * kBColumnBlocks) == 0 ? kBlockN / kBColumnBlocks : 64;

  static constexpr uint32_t kTileABytes = kBlockM * kBlockK * kElementBytes;
  static constexpr uint32_t kTileBBytes = kBlockK * kBColumnBlocks * kBBlockN * kElementBytes;
  // FP8 K slices bring their scales: kBlockM fp32 of A's, and one box of B's, 8 column blocks of
  // 128 from the 4-aligned block at or before the tile's first (TMA's innermost box coordinate
  // falls on 16 bytes; a tile up to 256 wide then spans at most blocks 0..4 of the box), in a
  // slot of 128 bytes (TMA writes shared memory at 128-byte aligned addresses).
  static constexpr int kBScaleBox = 8;
  // A's scales come kBlockM to a stage, from the tile's first row; where a tile may start at any
  // row (ragged rows: a group starts anywhere), kAScaleBoxAnyRow of them from the 4-aligned row
  // at or before it, for the same reason (mainloop/sm90_tma_wgmma_fp8.cuh).
  static constexpr int kAScaleBoxAnyRow = kBlockM + 4;
  static constexpr int kBScaleSlotBytes = 128;
  static constexpr uint32_t kTileScaleBytes =
      kElementBytes == 1 ? kBlockM * sizeof(float) + kBScaleSlotBytes : 0;
  static constexpr uint32_t kStageBytes = kTileABytes + kTileBBytes + kTileScaleBytes;

  // Epilogue staging: per consumer warpgroup, kEpilogueBuffers chunks of 64 rows x 128 bytes
  // (64 16-bit or 32 fp32 columns), each one 128-byte-swizzled TMA store box. By default a
  // warpgroup's whole 16-bit block, so its epilogue is one batch (epilogue/tma_store.cuh);
  // fewer buffers leave room for more stages.
  static constexpr int kEpilogueRows = 64;
  static constexpr int kEpilogueRowBytes = 128;
  static constexpr uint32_t kEpilogueChunkBytes = kEpilogueRows * kEpilogueRowBytes;
  static constexpr int kEpilogueBuffers = kEpilogueBuffers_;
  static constexpr uint32_t kEpilogueBytes =
      kEpilogue == EpilogueKind::kTmaStore
          ? kConsumerWarpgroups * kEpilogueBuffers * kEpilogueChunkBytes
          : 0;

  // Operand ring (up to the 1024-byte boundary where the staging starts: FP8 stages' scales
  // leave the ring a multiple of 128 bytes) + epilogue staging + two mbarriers per stage (with
  // up to 64 bytes of padding before them) + the epilogue's barriers and handoff slots
  // (kernels/sm90_gemm_kernel.cuh) + slack to align the base to 1024 bytes (the 128-byte swizzle
  // pattern repeats every 1024 bytes, keyed to the address).
  static constexpr uint32_t kRingBytes = (kStages * kStageBytes + 1023) / 1024 * 1024;
  static constexpr uint32_t kSmemBytes =
      kRingBytes + kEpilogueBytes + kStages * 16 + 64 + 160 + 1024;

  static_assert(kElementBytes == 1 || kElementBytes == 2, "16-bit or FP8 elements");
  static_assert(kBlockK == kSwizzleElems, "one K slice is one 128-byte swizzle row");
  static_assert(kBlockM == 64 || kBlockM == 128, "ping-pong 64-row or cooperative 128-row tiles");
  static_assert(kBlockN % 8 == 0 && kBlockN >= 64 && kBlockN <= 256,
                "wgmma N is a multiple of 8 up to 256; the epilogue stores 64-column chunks");
  static_assert(kClusterM == 1 || (kClusterM == 2 && kBColumnBlocks >= 2),
                "a cluster of 2 splits B's column blocks between its CTAs");
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the 227 KB of shared memory per block");
};

// A tile of 1-byte (FP8) elements: the FP8 products' (contract/sm90_fp8.h).
template <int kBlockM, int kBlockN, int kStages, int kClusterM,
          int kEpilogueBuffers = (kBlockN + 63) / 64>
using Fp8Tile =
    TileConfig<kBlockM, kBlockN, kStages, kClusterM, EpilogueKind::kTmaStore, kEpilogueBuffers, 1>;

}  // namespace jax_tma::sm90_gemm

// The compiled configurations (Tile128x256C2, ...: aliases of TileConfig and Fp8Tile) and the
// X-macro lists of kernels, JAX_TMA_SM90_GEMM_KERNELS(X) among them (X(tile, layout) for every
// pair the instantiation files and ffi/gemm.cc expand): generated from the tile registry,
// jax_tma/_core/tiles.py, by scripts/gen_tiles.py.
#include "contract/sm90_tiles.generated.h"

namespace jax_tma::sm90_gemm {

// Which of an operand's two matrix dimensions is contiguous in memory: K, or the other one
// (M for A, N for B). The values are wgmma's transpose immediates (0: K-major, 1: MN-major).
enum class Major : int { kK = 0, kMN = 1 };

template <Major kA_, Major kB_>
struct OperandLayout {
  static constexpr Major kA = kA_;
  static constexpr Major kB = kB_;
};
// Named as in BLAS, op(A) op(B) with T meaning "stored transposed".
using LayoutNN = OperandLayout<Major::kK, Major::kMN>;   // A [M, K], B [K, N]
using LayoutNT = OperandLayout<Major::kK, Major::kK>;    // A [M, K], B [N, K]
using LayoutTN = OperandLayout<Major::kMN, Major::kMN>;  // A [K, M], B [K, N]
using LayoutTT = OperandLayout<Major::kMN, Major::kK>;   // A [K, M], B [N, K]

// An operand's tensor map is rank 3: {contiguous dimension, the other one, batch}. These put
// (MN, K) coordinates or extents in that order, for the host's map and the device's copies.
template <class T>
struct InnerOuter {
  T inner, outer;
};
template <Major kMajor, class T>
__host__ __device__ constexpr InnerOuter<T> inner_outer(T mn, T k) {
  return kMajor == Major::kK ? InnerOuter<T>{k, mn} : InnerOuter<T>{mn, k};
}

// TMA boxes of one (tile, layout) pair, innermost dimension first. Every box is one 128-byte
// swizzle row wide and covers 64 M or N indices, so that a tile's boxes wholly past the matrix
// can be left out (MainloopSm90TmaWgmma::load). A: kBlockM / 64 boxes, as 64 M rows x 64 K
// (K-major) or 64 K rows x 64 M (M-major). B: kBlockN / 64 boxes (rounded up), as 64 K rows x
// 64 N (N-major) or 64 N rows x 64 K (K-major).
template <class Tile, class Layout>
struct OperandBoxes {
  static constexpr bool kAKMajor = Layout::kA == Major::kK;
  static constexpr bool kBKMajor = Layout::kB == Major::kK;
  static constexpr int kABoxMN = 64;
  static constexpr int kBoxA[3] = {Tile::kSwizzleElems, 64, 1};
  static constexpr int kALoads = Tile::kBlockM / kABoxMN;
  static constexpr int kBBoxMN = Tile::kBBlockN;
  static constexpr int kBoxB[3] = {Tile::kSwizzleElems, kBKMajor ? kBBoxMN : Tile::kBlockK, 1};
  static_assert(kBKMajor || kBBoxMN == 64, "an N-major B box is one 128-byte row of 64 N");
  static constexpr int kBLoads = Tile::kBColumnBlocks;
  static constexpr uint32_t kABoxBytes = kBoxA[0] * kBoxA[1] * Tile::kElementBytes;
  static constexpr uint32_t kBBoxBytes = kBoxB[0] * kBoxB[1] * Tile::kElementBytes;

  static_assert(kALoads * kABoxBytes == Tile::kTileABytes, "A boxes tile the A stage");
  static_assert(kBLoads * kBBoxBytes == Tile::kTileBBytes, "B boxes tile the B stage");
  static_assert(kBoxA[1] <= 256 && kBoxB[1] <= 256, "TMA box dimensions are at most 256");

  // Rows of A's box for a product of `m` rows. NOTE: TMA zero-fills the rows of a box that lie
  // past the matrix, but slowly: a decode-like product (M = 1, 64-row box) ran markedly longer
  // than with 64 real rows (docs/notebook/2026-11-29-tile-registry-figures.md). So a K-major A shorter than one box is loaded as a box of its own
  // rows; the stage's remaining rows keep stale data, which only reaches output rows >= m,
  // and the epilogue never stores those.
  static constexpr int a_rows(int64_t m) {
    return kAKMajor && m < kABoxMN ? static_cast<int>(m) : kABoxMN;
  }
  // Bytes all of A's boxes bring into one stage for a product of `m` rows
  // (GemmShape::a_stage_bytes): Tile::kTileABytes unless a_rows(m) shortens the box.
  static constexpr uint32_t a_stage_bytes(int64_t m) {
    return kALoads * static_cast<uint32_t>(a_rows(m)) * Tile::kSwizzleElems * Tile::kElementBytes;
  }
  static_assert(a_stage_bytes(kABoxMN) == Tile::kTileABytes);
};

struct GemmShape {
  int m, n, k;
  int batch;
  int splits;               // K ranges, one partial product each (D's outer dimension)
  int k_blocks_per_split;   // kBlockK slices per K range; the last range may be shorter
  bool a_batched;           // false: A is one matrix for every batch entry (coordinate 0)
  bool b_batched;
  // Bytes of A that one stage receives when all of A's boxes load: Tile::kTileABytes, or less
  // when A is K-major and has fewer rows than one box (see OperandBoxes::a_rows).
  uint32_t a_stage_bytes;
  // Element strides of D (its N stride is 1); the direct-store epilogue addresses D with them.
  int64_t d_m_stride, d_batch_stride, d_split_stride;
};

// Stream-K workspace (epilogue/partial_tiles.cuh) for a grid of `ctas` CTAs of block_m x
// block_n tiles: one uint32 flag per slot, padded to 256 bytes, then the slots, one per
// consumer warpgroup (TileConfig::kConsumerWarpgroups), together one fp32 tile per CTA.
inline constexpr int kStreamKSlotsPerCta = 2;
inline constexpr int64_t stream_k_flag_bytes(int64_t ctas) {
  return (ctas * kStreamKSlotsPerCta * 4 + 255) / 256 * 256;
}
inline constexpr int64_t stream_k_workspace_bytes(int64_t ctas, int block_m, int block_n) {
  return stream_k_flag_bytes(ctas) + ctas * block_m * block_n * 4;
}
// The most CTAs a workspace of `bytes` serves.
inline int64_t stream_k_capacity(int64_t bytes, int block_m, int block_n) {
  int64_t ctas = bytes / (block_m * block_n * 4);
  while (ctas > 0 && stream_k_workspace_bytes(ctas, block_m, block_n) > bytes) --ctas;
  return ctas;
}

struct LaunchArgs {
  const CUtensorMap* tmap_a;  // {inner, outer, batch}: see inner_outer and OperandBoxes
  const CUtensorMap* tmap_b;
  const CUtensorMap* tmap_d;  // {N, M, batch, splits}, box: one epilogue chunk (kTmaStore only)
  void* d;                    // base of D (kDirect only)
  // Stream-K: deal the last wave's K slices out to every CTA (Tile::kStreamK only), with
  // this workspace (stream_k_workspace_bytes; its flags are zeroed on the stream first).
  bool stream_k;
  void* workspace;
  int64_t workspace_bytes;
  GemmShape shape;
  int num_sms;
  cudaStream_t stream;
};

// Defined in sm90_gemm_<in>_<out>.cu for every (In, Out, Tile, Layout) that ffi/gemm.cc
// dispatches to.
template <class In, class Out, class Tile, class Layout>
cudaError_t launch(const LaunchArgs& args);

}  // namespace jax_tma::sm90_gemm
