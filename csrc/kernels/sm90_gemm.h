// Host-visible contract of the sm90 GEMM kernel: tile configurations, their shared-memory
// budgets and TMA box shapes, and the launch entry points. Included by the FFI handler and by
// the kernel, so host and device read every size from the same constexpr.
//
// Layout: A is M x K row-major (K contiguous), B is K x N row-major (N contiguous). D is
// [splits, M, N] row-major with leading dimension ldd (splits = 1: the product itself; split-K:
// one fp32 partial product per K range, summed by the caller). Inputs bf16 or fp16,
// accumulation fp32, output the input type or fp32.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_tma::sm90_gemm {

enum class DType : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

inline constexpr int dtype_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// How the consumers write D: through shared memory and TMA stores (needs 16-byte aligned rows
// of D), or straight from registers with bounds checks (any N).
enum class EpilogueKind : int { kTmaStore = 0, kDirect = 1 };

// One compiled CTA tile configuration. kBlockM / 64 consumer warpgroups split BLOCK_M; one
// producer warpgroup issues the copies. With kClusterM = 2, the two CTAs of a cluster take
// vertically adjacent tiles and each multicasts half of the shared B slice to both.
template <int kBlockM_, int kBlockN_, int kStages_, int kClusterM_, EpilogueKind kEpilogue_>
struct TileConfig {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockK = 64;  // one 128-byte swizzle row of 16-bit elements
  static constexpr int kStages = kStages_;
  static constexpr int kClusterM = kClusterM_;
  static constexpr EpilogueKind kEpilogue = kEpilogue_;
  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kElementBytes = 2;

  // TMA boxes, innermost dimension first. B arrives as kBlockN / 64 boxes of 64 columns, each
  // one 128-byte swizzle atom wide.
  static constexpr int kBoxA[2] = {kBlockK, kBlockM};
  static constexpr int kBoxB[2] = {64, kBlockK};
  static constexpr int kBColumnBlocks = kBlockN / 64;

  static constexpr uint32_t kTileABytes = kBlockM * kBlockK * kElementBytes;
  static constexpr uint32_t kTileBBytes = kBlockK * kBlockN * kElementBytes;
  static constexpr uint32_t kStageBytes = kTileABytes + kTileBBytes;

  // Epilogue staging: per consumer warpgroup, kEpilogueBuffers chunks of 64 rows x 128 bytes
  // (64 16-bit or 32 fp32 columns), each one 128-byte-swizzled TMA store box.
  static constexpr int kEpilogueRows = 64;
  static constexpr uint32_t kEpilogueChunkBytes = kEpilogueRows * 128;
  static constexpr int kEpilogueBuffers = 2;
  static constexpr uint32_t kEpilogueBytes =
      kEpilogue == EpilogueKind::kTmaStore
          ? kConsumerWarpgroups * kEpilogueBuffers * kEpilogueChunkBytes
          : 0;

  // Operand ring + epilogue staging + two mbarriers per stage (with up to 64 bytes of
  // padding before them) + slack to align the base to 1024 bytes (the 128-byte swizzle
  // pattern repeats every 1024 bytes, keyed to the address).
  static constexpr uint32_t kSmemBytes =
      kStages * kStageBytes + kEpilogueBytes + kStages * 16 + 64 + 1024;

  static_assert(kBlockM == 64 || kBlockM == 128, "one or two consumer warpgroups");
  static_assert(kBlockN % 64 == 0 && kBlockN <= 256, "wgmma N is at most 256");
  static_assert(kClusterM == 1 || (kClusterM == 2 && kBColumnBlocks % 2 == 0),
                "a cluster of 2 splits B's column blocks between its CTAs");
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the 227 KB of shared memory per block");
};

// The configurations compiled into the extension; jax_tma/gemm.py mirrors this list
// (_COMPILED_TILES), and ffi/gemm.cc dispatches on it.
using Tile128x256C2 = TileConfig<128, 256, 4, 2, EpilogueKind::kTmaStore>;
using Tile128x256 = TileConfig<128, 256, 4, 1, EpilogueKind::kTmaStore>;
using Tile128x128C2 = TileConfig<128, 128, 6, 2, EpilogueKind::kTmaStore>;
using Tile128x128 = TileConfig<128, 128, 6, 1, EpilogueKind::kTmaStore>;
using Tile64x128 = TileConfig<64, 128, 8, 1, EpilogueKind::kTmaStore>;
using Tile128x128Direct = TileConfig<128, 128, 6, 1, EpilogueKind::kDirect>;
using Tile64x128Direct = TileConfig<64, 128, 8, 1, EpilogueKind::kDirect>;

// The list above as an X-macro: the instantiation files and the dispatcher in ffi/gemm.cc
// expand it, so a configuration is added in one place.
#define JAX_TMA_SM90_GEMM_TILES(X) \
  X(Tile128x256C2)                 \
  X(Tile128x256)                   \
  X(Tile128x128C2)                 \
  X(Tile128x128)                   \
  X(Tile64x128)                    \
  X(Tile128x128Direct)             \
  X(Tile64x128Direct)

struct GemmShape {
  int m, n, k;
  int splits;               // K ranges, one partial product each (D's outer dimension)
  int k_blocks_per_split;   // kBlockK slices per K range; the last range may be shorter
  int64_t ldd;              // elements between consecutive rows of D
};

struct LaunchArgs {
  const CUtensorMap* tmap_a;
  const CUtensorMap* tmap_b;
  const CUtensorMap* tmap_d;  // [splits, M, N], box: one epilogue chunk (kTmaStore only)
  void* d;                    // base of D (kDirect only)
  GemmShape shape;
  int num_sms;
  cudaStream_t stream;
};

// Defined in sm90_gemm_<in>_<out>.cu for every (In, Out, Tile) that ffi/gemm.cc dispatches to.
template <class In, class Out, class Tile>
cudaError_t launch(const LaunchArgs& args);

}  // namespace jax_tma::sm90_gemm
