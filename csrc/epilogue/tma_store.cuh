// Epilogue through shared memory and TMA stores: one consumer warpgroup writes its 64 x kBlockN
// accumulator block in chunks of 64 rows x 128 bytes (64 16-bit or 32 fp32 columns). Chunks are
// converted to the output type and written 128-byte swizzled (stmatrix for 16-bit outputs) into
// a staging area of kBuffers chunks, then handed to TMA stores that clip them to D's bounds.
// The staging area is filled in batches of kBuffers chunks: one wait, one fence and two named
// barriers per batch, so a block that fits the staging area takes one batch, whose wait is for
// the previous tile's stores (long done). The stores run asynchronously: the warpgroup goes on
// to the next tile's mainloop while they drain.
// D's tensor map is rank 4, {N, M, batch, split}, with a box of one chunk.
//
// Fused epilogues (epilogue/fusion.cuh) transform the accumulators on the way: a bias per column
// (read from global memory), an activation, an [M, N] operand (the residual, or the saved
// pre-activation of a gradient) loaded by TMA into the staging buffers and read back with
// ldmatrix in the accumulators' register layout (so it may alias D: each chunk is read before
// it is overwritten), and the pre-activation stored as a second output first when asked for.
// Gated: the accumulator's 64-column blocks alternate gate and up columns; the block stored is
// half as wide. Scaled: the accumulators are multiplied by their row's and column's scales (and
// the bias added) in place, before the passes.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "epilogue/fusion.cuh"
#include "pipeline/epilogue_load.cuh"
#include "pipeline/named_barrier.cuh"
#include "pipeline/tma_store_pipeline.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/math.cuh"
#include "ptx/pack.cuh"
#include "ptx/stmatrix.cuh"
#include "ptx/tma.cuh"

namespace jax_tma {

// a + b and a * b for two pairs of 16-bit values, each rounded once to Out. Bit for bit what
// the fp32 sum or product rounded to Out gives (unpack_pair, then pack_pair): the product of
// two 16-bit values is exact in fp32, and so is their sum unless their exponents lie more than
// 15 (fp16: 13) apart, where the smaller lies too far below the larger's half-ulp for either
// rounding to move.
template <class Out>
__device__ __forceinline__ uint32_t add_pairs(uint32_t a, uint32_t b) {
  if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
    return ptx::add_bf16x2(a, b);
  } else {
    static_assert(std::is_same_v<Out, __half>);
    return ptx::add_f16x2(a, b);
  }
}
template <class Out>
__device__ __forceinline__ uint32_t mul_pairs(uint32_t a, uint32_t b) {
  if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
    return ptx::mul_bf16x2(a, b);
  } else {
    static_assert(std::is_same_v<Out, __half>);
    return ptx::mul_f16x2(a, b);
  }
}

// `v` rounded to Out and back (a 16-bit type; fp32 as it is).
template <class Out>
__device__ __forceinline__ float2 round_pair(float2 v) {
  if constexpr (sizeof(Out) == 2) {
    return ptx::unpack_pair<Out>(ptx::pack_pair<Out>(v.x, v.y));
  } else {
    return v;
  }
}

// The staging area of one consumer warpgroup: kBuffers chunks of 64 rows x 128 bytes.
template <int kBuffers>
struct StagingBuffers {
  alignas(1024) uint8_t buffer[kBuffers][64 * 128];
};

// Where one consumer warpgroup's block goes: D's map (a kernel parameter, or a map in global
// memory) and the coordinates of the block's first element; `rows` and `cols` are D's extent
// in the map's coordinates: a block that starts past `rows`, or a chunk past `cols`, is not
// stored (TMA would clip all of it).
struct StorePlan {
  const CUtensorMap* d;
  int row, col, batch, split;
  int rows, cols;
};

// The maps and arguments of a fused epilogue (unused by PlainFusion): the [M, N] operand to
// read and the second output, both rank 4 like D with D's box, and the fusion's run-time flags.
struct FusedStore {
  const CUtensorMap* aux;
  const CUtensorMap* pre;
  const CUtensorMap* pre2;  // gated: the up pre-activations (pre: the gate's)
  FusionArgs args;
  EpilogueLoad* load;  // the warpgroup's barrier for the aux loads
};

template <class Out, int kBlockN, int kBuffers, class FusionT = PlainFusion>
struct TmaStoreEpilogue {
  using F = FusionT;
  static constexpr int kRows = 64;
  static constexpr int kChunkCols = 128 / static_cast<int>(sizeof(Out));
  // Columns of the stored block: gated blocks pair two accumulator columns per output column.
  static constexpr int kOutCols = kBlockN / F::kOutPerAcc;
  static constexpr int kChunks = (kOutCols + kChunkCols - 1) / kChunkCols;
  static constexpr uint32_t kChunkBytes = kRows * 128;
  static_assert(kChunks % kBuffers == 0, "the staging area holds whole batches of chunks");
  static_assert(kOutCols >= kChunkCols && kOutCols % 8 == 0,
                "chunks start on the accumulators' 8-column blocks");
  static_assert(!F::kGated || (sizeof(Out) == 2 && kBlockN % 128 == 0),
                "gated blocks are 16-bit and pair whole 64-column gate and up blocks");

  // First column of chunk `c` in the block. A width that is not a multiple of the chunk's
  // (232) ends with a chunk shifted left to end at the block's edge: it repeats columns of the
  // chunk before it, so both stores write the same values there, and no store reaches the next
  // tile's columns (TMA clips only at D's edge).
  static constexpr int chunk_col(int c) {
    return c * kChunkCols < kOutCols - kChunkCols ? c * kChunkCols : kOutCols - kChunkCols;
  }
  // One store group per batch, and the next batch rewrites the whole staging area.
  using StorePipeline = PipelineTmaStore<1>;

  using SharedStorage = StagingBuffers<kBuffers>;
  static_assert(sizeof(SharedStorage::buffer[0]) == kChunkBytes);

  // What a pass over the staging area writes: the output, or a pre-activation (BiasActivation:
  // z; gated: the gate's and then the up's).
  enum class Pass { kOut, kPre, kPreUp };

  // Byte offset of 16-byte unit `unit` of row `row` in a 128-byte-swizzled chunk.
  __device__ static uint32_t swizzled(int row, int unit) {
    return static_cast<uint32_t>(row * 128 + ((unit ^ (row & 7)) << 4));
  }

  // The values stored for one pair of adjacent output columns `col`, `col` + 1 (relative to
  // the block; `col0` + col in D) from the accumulator pair `x` (and, gated, the up pair `up`),
  // with the aux pair `aux` when the pass reads one.
  template <Pass kPass, bool kAux>
  __device__ static float2 fuse(float2 x, float2 up, float2 aux, int col, const StorePlan& to,
                                const FusionArgs& args) {
    // Gated and BiasActivation round where the unfused 16-bit expression does (the
    // epilogue warps' rounding, epilogue/epilogue_warps.cuh): the products, the bias sum, the
    // activation; the last rounding is the store's.
    if constexpr (F::kKind == FusionKind::kGated) {
      if constexpr (kPass == Pass::kPre) return x;
      if constexpr (kPass == Pass::kPreUp) return up;
      x = round_pair<Out>(x);
      up = round_pair<Out>(up);
      const float2 a = round_pair<Out>(
          make_float2(activate<F::kAct>(x.x), activate<F::kAct>(x.y)));
      return make_float2(a.x * up.x, a.y * up.y);
    } else if constexpr (F::kKind == FusionKind::kActivationGrad) {
      x = round_pair<Out>(x);  // the product's rounding, as unfused
      return make_float2(x.x * activate_grad<F::kAct>(aux.x),
                         x.y * activate_grad<F::kAct>(aux.y));
    } else if constexpr (F::kKind == FusionKind::kBiasActivation) {
      // The bias is in the accumulators already (add_bias, which rounds the sum).
      if constexpr (kPass == Pass::kPre) return x;
      x = round_pair<Out>(x);
      if constexpr (F::kAct != Activation::kNone) {
        x = make_float2(activate<F::kAct>(x.x), activate<F::kAct>(x.y));
        if constexpr (kAux) x = round_pair<Out>(x);
      }
      if constexpr (kAux) x = make_float2(x.x + aux.x, x.y + aux.y);
      return x;
    } else {
      return x;
    }
  }

  // Chunk `c` of the accumulators (layout: ptx/wgmma.cuh) into the staging buffer at `base`.
  template <int c, Pass kPass, bool kAux>
  __device__ static void write_chunk(const float (&acc)[kBlockN / 2], uint32_t base,
                                     const StorePlan& to, const FusionArgs& args) {
    const int lane = threadIdx.x % 32;
    const int warp = (threadIdx.x / 32) % 4;
    if constexpr (sizeof(Out) == 2) {
      // One stmatrix.x4 per 16 x 16 block: matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15)
      // come from registers 8q + {0,1}, {2,3}, {4,5}, {6,7}; lane l addresses row l % 8 of
      // matrix l / 8. An aux operand comes back through ldmatrix in the same layout.
      // The chunk's aux blocks are all read before the first is overwritten: the shared
      // accesses are volatile, so each read after a store would wait for it, and the chunk's
      // ldmatrix round trips would run one after another.
      const int matrix = lane / 8;
      const int row = 16 * warp + (matrix & 1) * 8 + (lane & 7);
      ptx::Fragment4 aux[kChunkCols / 16] = {};
      if constexpr (kAux) {
#pragma unroll
        for (int qq = 0; qq < kChunkCols / 16; ++qq) {
          aux[qq] = ptx::ldmatrix_x4(base + swizzled(row, 2 * qq + (matrix >> 1)));
        }
      }
#pragma unroll
      for (int qq = 0; qq < kChunkCols / 16; ++qq) {
        // Registers of the chunk's 8-column blocks 2qq and 2qq + 1 (4 per block); gated: of
        // the gate block, the up block's 32 registers later.
        constexpr int kFirst = F::kGated ? 64 * c : 4 * (chunk_col(c) / 8);
        const int r = kFirst + 8 * qq;
        const uint32_t addr = base + swizzled(row, 2 * qq + (matrix >> 1));
        uint32_t packed[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // Register pair i: rows + 8 (i & 1), columns 8 (i >> 1) + 2 (lane % 4) of the block.
          const int col = chunk_col(c) + 16 * qq + 8 * (i >> 1) + 2 * (lane % 4);
          const float2 x = make_float2(acc[r + 2 * i], acc[r + 2 * i + 1]);
          float2 up = x;
          if constexpr (F::kGated) up = make_float2(acc[r + 32 + 2 * i], acc[r + 32 + 2 * i + 1]);
          const float2 a = kAux ? ptx::unpack_pair<Out>(aux[qq].r[i]) : make_float2(0.0f, 0.0f);
          const float2 v = fuse<kPass, kAux>(x, up, a, col, to, args);
          packed[i] = ptx::pack_pair<Out>(v.x, v.y);
        }
        ptx::stmatrix_x4(addr, packed[0], packed[1], packed[2], packed[3]);
      }
    } else {
      // fp32: each thread owns two adjacent columns of rows r and r + 8 per 8-column block.
      // (The chunk's aux values read first, as above.)
      const int row = 16 * warp + lane / 4;
      const int pair = lane % 4;
      const auto address = [&](int jj, int h) {
        return base + swizzled(row + 8 * h, 2 * jj + pair / 2) + (pair & 1) * 8;
      };
      float2 aux[kChunkCols / 8][2] = {};
      if constexpr (kAux) {
#pragma unroll
        for (int jj = 0; jj < kChunkCols / 8; ++jj) {
#pragma unroll
          for (int h = 0; h < 2; ++h) aux[jj][h] = ptx::ld_shared_v2_f32(address(jj, h));
        }
      }
#pragma unroll
      for (int jj = 0; jj < kChunkCols / 8; ++jj) {
        const int j = chunk_col(c) / 8 + jj;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float2 x = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
          const float2 v = fuse<kPass, kAux>(x, x, aux[jj][h], 8 * j + 2 * pair, to, args);
          ptx::st_shared_v2_f32(address(jj, h), v.x, v.y);
        }
      }
    }
  }

  // Chunks batch0 .. batch0 + kBuffers - 1 into the staging area, chunk batch0 + i in buffer i.
  template <int batch0, Pass kPass, bool kAux, int... i>
  __device__ static void write_batch(const float (&acc)[kBlockN / 2], SharedStorage& smem,
                                     const StorePlan& to, const FusionArgs& args,
                                     std::integer_sequence<int, i...>) {
    (write_chunk<batch0 + i, kPass, kAux>(acc, ptx::smem_u32(smem.buffer[i]), to, args), ...);
  }

  // Issuer: the batch's chunks from the staging area to `map` (chunks past D's columns are
  // left out), as one store group.
  template <int batch0>
  __device__ static void issue_stores(const CUtensorMap* map, SharedStorage& smem,
                                      const StorePlan& to) {
#pragma unroll
    for (int i = 0; i < kBuffers; ++i) {
      // NOTE: to.col < to.cols, so neither sum wraps past 2^31.
      if (chunk_col(batch0 + i) >= to.cols - to.col) break;  // this chunk and the rest: past D
      ptx::tma_store(map, smem.buffer[i],
                     ptx::TmaCoord<4>{{to.col + chunk_col(batch0 + i), to.row, to.batch,
                                       to.split}});
    }
    StorePipeline::producer_commit();
  }

  // A pass that stores a pre-activation through `map` and waits until the stores have read the
  // staging area (the next pass rewrites it).
  template <int batch0, Pass kPass>
  __device__ static void store_pass(const float (&acc)[kBlockN / 2], SharedStorage& smem,
                                    const StorePlan& to, const NamedBarrier& barrier,
                                    const FusionArgs& args, const CUtensorMap* map) {
    write_batch<batch0, kPass, false>(acc, smem, to, args,
                                      std::make_integer_sequence<int, kBuffers>{});
    ptx::fence_proxy_async_shared();
    barrier.sync();
    if (threadIdx.x % 128 == 0) {
      issue_stores<batch0>(map, smem, to);
      StorePipeline::producer_tail();
    }
    barrier.sync();
  }

  // Issuer: the aux operand's chunks of batch batch0 into the staging area (those past D's
  // columns left out), completing on the warpgroup's epilogue-load barrier.
  template <int batch0>
  __device__ static void load_aux(SharedStorage& smem, const StorePlan& to,
                                  const FusedStore& fused) {
    int boxes = 0;
#pragma unroll
    for (int i = 0; i < kBuffers; ++i) boxes += chunk_col(batch0 + i) < to.cols - to.col;
    uint64_t* bar = fused.load->arm(boxes * kChunkBytes);
#pragma unroll
    for (int i = 0; i < kBuffers; ++i) {
      if (i == boxes) break;
      ptx::tma_load(smem.buffer[i], fused.aux, bar,
                    ptx::TmaCoord<4>{{to.col + chunk_col(batch0 + i), to.row, to.batch,
                                      to.split}});
    }
  }

  // Issuer, while the tile's mainloop runs: the first batch's aux chunks into the staging area
  // once the previous tile's stores have read it, so that the epilogue finds them there
  // (store(..., prefetched = true)). Only for a fusion that reads the aux operand without first
  // storing a pre-activation through the same buffers.
  __device__ static void prefetch_aux(SharedStorage& smem, const StorePlan& to,
                                      const FusedStore& fused) {
    StorePipeline::producer_acquire();
    load_aux<0>(smem, to, fused);
  }

  // One batch: (fused, asked for) the pre-activation through fused.pre, then (fused, asked for)
  // the aux operand into the staging area, then the output.
  template <int batch0, bool kAux>
  __device__ static void store_batch(const float (&acc)[kBlockN / 2], SharedStorage& smem,
                                     const StorePlan& to, const NamedBarrier& barrier,
                                     const FusedStore& fused, bool prefetched) {
    const bool issuer = threadIdx.x % 128 == 0;
    constexpr auto kBuffersSeq = std::make_integer_sequence<int, kBuffers>{};
    if (issuer) StorePipeline::producer_acquire();
    barrier.sync();  // the previous batch's stores have read the staging area
    if constexpr (F::kKind == FusionKind::kBiasActivation || F::kGated) {
      if (fused.args.store_pre) {
        store_pass<batch0, Pass::kPre>(acc, smem, to, barrier, fused.args, fused.pre);
        if constexpr (F::kGated) {
          store_pass<batch0, Pass::kPreUp>(acc, smem, to, barrier, fused.args, fused.pre2);
        }
      }
    }
    if constexpr (kAux) {
      if (issuer && !(batch0 == 0 && prefetched)) load_aux<batch0>(smem, to, fused);
      fused.load->wait();
    }
    write_batch<batch0, Pass::kOut, kAux>(acc, smem, to, fused.args, kBuffersSeq);
    ptx::fence_proxy_async_shared();
    barrier.sync();  // the whole batch is visible to the TMA unit
    if (issuer) issue_stores<batch0>(to.d, smem, to);
    if constexpr (batch0 + kBuffers < kChunks) {
      store_batch<batch0 + kBuffers, kAux>(acc, smem, to, barrier, fused, false);
    }
  }

  // BiasActivation, Scaled: acc += bias[col] once, before the passes that read z. Columns past
  // D's get none (N % 8 == 0, so a pair is wholly in or out). `T`: the bias's element type.
  // BiasActivation rounds the product and the sum to Out (Scaled adds to the fp32 product).
  template <class T>
  __device__ static void add_bias(float (&acc)[kBlockN / 2], const StorePlan& to, const T* bias) {
    constexpr bool kRound = F::kKind == FusionKind::kBiasActivation;
    const int pair_col = to.col + 2 * (threadIdx.x % 4);
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      const int col = pair_col + 8 * j;
      float2 b = make_float2(0.0f, 0.0f);
      if (col < to.cols) {
        if constexpr (std::is_same_v<T, float>) {
          b = __ldg(reinterpret_cast<const float2*>(bias + col));
        } else {
          b = ptx::unpack_pair<T>(__ldg(reinterpret_cast<const unsigned int*>(bias + col)));
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float2 z = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        if constexpr (kRound) z = round_pair<Out>(z);
        z = make_float2(z.x + b.x, z.y + b.y);
        if constexpr (kRound) z = round_pair<Out>(z);
        acc[4 * j + 2 * h] = z.x;
        acc[4 * j + 2 * h + 1] = z.y;
      }
    }
  }
  __device__ static void add_bias(float (&acc)[kBlockN / 2], const StorePlan& to,
                                  const FusionArgs& args) {
    switch (args.bias_type) {
      case VectorType::kBF16:
        add_bias(acc, to, static_cast<const __nv_bfloat16*>(args.bias));
        break;
      case VectorType::kF16:
        add_bias(acc, to, static_cast<const __half*>(args.bias));
        break;
      default:
        add_bias(acc, to, static_cast<const float*>(args.bias));
    }
  }

  // Scaled: acc *= row_scale[row] * col_scale[col], either factor left out where null (or one
  // value for all where scalar). Rows and columns past D's get no scale (their values are
  // never stored).
  __device__ static void scale(float (&acc)[kBlockN / 2], const StorePlan& to,
                               const FusionArgs& args) {
    if (const float* row_scale = args.row_scale; row_scale != nullptr) {
      const int row = to.row + 16 * ((threadIdx.x / 32) % 4) + (threadIdx.x % 32) / 4;
      const float all = args.row_scale_scalar ? __ldg(row_scale) : 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // NOTE: to.row < to.rows, so the sum cannot pass 2^31.
        const float s = args.row_scale_scalar     ? all
                        : row + 8 * h < to.rows ? __ldg(row_scale + row + 8 * h)
                                                : 0.0f;
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          acc[4 * j + 2 * h] *= s;
          acc[4 * j + 2 * h + 1] *= s;
        }
      }
    }
    if (const float* col_scale = args.col_scale; col_scale != nullptr) {
      const int pair_col = to.col + 2 * (threadIdx.x % 4);
      const float all = args.col_scale_scalar ? __ldg(col_scale) : 0.0f;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const int col = pair_col + 8 * j;
        // As for the bias, N is even: a pair is wholly in or out.
        const float2 s = args.col_scale_scalar ? make_float2(all, all)
                         : col < to.cols
                             ? __ldg(reinterpret_cast<const float2*>(col_scale + col))
                             : make_float2(0.0f, 0.0f);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          acc[4 * j + 2 * h] *= s.x;
          acc[4 * j + 2 * h + 1] *= s.y;
        }
      }
    }
  }

  // Stores the warpgroup's block at `to` (the caller skips blocks past to.rows). `barrier`
  // spans the warpgroup; thread 0 of the warpgroup issues (and owns) every store. A fused
  // epilogue may change `acc` (the bias is added in place).
  // `prefetched`: prefetch_aux has loaded the first batch's aux chunks. kReadsAux = false: the
  // caller never passes an aux operand (its pass is not compiled).
  template <bool kReadsAux = F::kMayReadAux>
  __device__ static void store(float (&acc)[kBlockN / 2], SharedStorage& smem,
                               const StorePlan& to, const NamedBarrier& barrier,
                               const FusedStore& fused = {}, bool prefetched = false) {
    if constexpr (F::kKind == FusionKind::kScaled) {
      scale(acc, to, fused.args);
    }
    if constexpr (F::kKind == FusionKind::kBiasActivation || F::kKind == FusionKind::kScaled) {
      if (fused.args.bias != nullptr) add_bias(acc, to, fused.args);
    }
    if constexpr (F::kMayReadAux && kReadsAux) {
      if (fused.args.aux) {
        store_batch<0, true>(acc, smem, to, barrier, fused, prefetched);
        return;
      }
    }
    store_batch<0, false>(acc, smem, to, barrier, fused, false);
  }

  // Stores a block of zeros at `to`, as store() does a block of accumulators.
  template <int batch0 = 0>
  __device__ static void store_zeros(SharedStorage& smem, const StorePlan& to,
                                     const NamedBarrier& barrier) {
    const bool issuer = threadIdx.x % 128 == 0;
    if (issuer) StorePipeline::producer_acquire();
    barrier.sync();
    if constexpr (batch0 == 0) {  // later batches find the zeros the first one wrote
      constexpr int kUnits = kBuffers * kChunkBytes / 16;
#pragma unroll
      for (int u = threadIdx.x % 128; u < kUnits; u += 128) {
        reinterpret_cast<uint4*>(&smem.buffer[0][0])[u] = make_uint4(0, 0, 0, 0);
      }
      ptx::fence_proxy_async_shared();
      barrier.sync();
    }
    if (issuer) issue_stores<batch0>(to.d, smem, to);
    if constexpr (batch0 + kBuffers < kChunks) store_zeros<batch0 + kBuffers>(smem, to, barrier);
  }

  // Before the CTA exits: every store issued by this warpgroup has read its staging buffer.
  __device__ static void finish() {
    if (threadIdx.x % 128 == 0) StorePipeline::producer_tail();
  }
};

}  // namespace jax_tma
