// Host-visible contract of the sm90 GEMM kernel: tile configurations, their shared-memory
// budgets and TMA box shapes, and the launch entry points. Included by the FFI handler and by
// the kernel, so host and device read every size from the same constexpr.
//
// Layout: A is M x K row-major (K contiguous), B is K x N row-major (N contiguous), D is M x N
// row-major with leading dimension ldd. Inputs bf16 or fp16, accumulation fp32, output bf16,
// fp16 or fp32.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_tma::sm90_gemm {

enum class DType : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

inline constexpr int dtype_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// One compiled CTA tile configuration. Two consumer warpgroups split BLOCK_M; one producer
// warpgroup issues the copies.
template <int kBlockN_, int kStages_>
struct TileConfig {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockK = 64;  // one 128-byte swizzle row of 16-bit elements
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kElementBytes = 2;

  // TMA boxes, innermost dimension first. B arrives as kBlockN / 64 boxes of 64 columns, each
  // one 128-byte swizzle atom wide.
  static constexpr int kBoxA[2] = {kBlockK, kBlockM};
  static constexpr int kBoxB[2] = {64, kBlockK};

  static constexpr uint32_t kTileABytes = kBlockM * kBlockK * kElementBytes;
  static constexpr uint32_t kTileBBytes = kBlockK * kBlockN * kElementBytes;
  static constexpr uint32_t kStageBytes = kTileABytes + kTileBBytes;
  // Operand ring + two mbarriers per stage + slack to align the base to 1024 bytes (the
  // 128-byte swizzle pattern repeats every 1024 bytes and is keyed to the address).
  static constexpr uint32_t kSmemBytes = kStages * kStageBytes + kStages * 16 + 1024;

  static_assert(kBlockN % 64 == 0 && kBlockN <= 256, "wgmma N is at most 256");
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the 227 KB of shared memory per block");
};

// The configurations compiled into the extension; jax_tma/gemm.py mirrors this list.
using Tile128x128 = TileConfig<128, 6>;
using Tile128x256 = TileConfig<256, 4>;

struct GemmShape {
  int m, n, k;
  int64_t ldd;  // elements between consecutive rows of D
};

struct LaunchArgs {
  const CUtensorMap* tmap_a;
  const CUtensorMap* tmap_b;
  void* d;
  GemmShape shape;
  int num_sms;
  cudaStream_t stream;
};

// Defined in sm90_gemm_<in>.cu for every (In, Out, Tile) the dispatcher in ffi/gemm.cc names.
template <class In, class Out, class Tile>
cudaError_t launch(const LaunchArgs& args);

}  // namespace jax_tma::sm90_gemm
