// Purpose-built kernels that prove the PTX and pipeline primitives on the GPU, one launcher per
// test. Only the jax_tma._testing FFI targets (testing/primitives_ffi.cc) call these.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_tma::testing {

// Round trip through shared memory: every box of `map_in` is TMA-loaded, its shared-memory
// image copied to images[box] (box_bytes each), then TMA-stored through `map_out`.
struct RoundTripArgs {
  const CUtensorMap* map_in;
  const CUtensorMap* map_out;
  int rank;
  int box_counts[5];  // boxes along each dimension, innermost first
  int box[5];         // box extent along each dimension
  uint32_t box_bytes;
  uint8_t* images;
  int32_t* timeouts;
  uint64_t timeout_cycles;
};
cudaError_t launch_tma_round_trip(const RoundTripArgs& args, cudaStream_t stream);

// y += x for 2-D tensors through TMA reduce-add stores, one box per CTA.
struct ReduceAddArgs {
  const CUtensorMap* map_x;
  const CUtensorMap* map_y;
  int box_counts[2];
  int box[2];
  uint32_t box_bytes;
  int32_t* timeouts;
  uint64_t timeout_cycles;
};
cudaError_t launch_tma_reduce_add(const ReduceAddArgs& args, cudaStream_t stream);

// Multicast within one cluster of cluster_m x cluster_n CTAs. CTA i (if bit i of `issuers`)
// loads rows [i * box_rows, (i + 1) * box_rows) of x and multicasts it to its mask: `mask`
// when mode == 0, the CTAs of its n column when mode == 1, of its m row when mode == 2. Every
// CTA dumps its cluster_size slots (initialised to 0xA5) to images[cta][slot].
struct MulticastArgs {
  const CUtensorMap* map_x;
  int cluster_m;
  int cluster_n;
  uint32_t issuers;
  uint32_t mask;
  int mode;
  uint32_t extra_tx_bytes;  // deliberately wrong expect_tx, for the timeout test
  int box_rows;
  uint32_t box_bytes;
  uint8_t* images;
  int32_t* timeouts;  // one per CTA
  uint64_t timeout_cycles;
};
cudaError_t launch_tma_multicast(const MulticastArgs& args, cudaStream_t stream);

// Producer warp -> consumer warps through a PipelineAsync ring of `stages` int32 slots for
// `iterations` steps. Each consumer warp records, per iteration, the value it read.
struct PhaseArgs {
  int stages;  // 2 or 4
  int consumers;
  int iterations;
  int32_t* seen;  // [consumers, iterations]
  int32_t* timeouts;
  uint64_t timeout_cycles;
};
cudaError_t launch_pipeline_phases(const PhaseArgs& args, cudaStream_t stream);

// The fused epilogues' packed 16-bit arithmetic (epilogue/tma_store.cuh): sum[i] =
// add_pairs(a[i], b[i]) and product[i] = mul_pairs(a[i], b[i]), each word two bf16 values (or
// fp16 where `half`).
struct PairMathArgs {
  const uint32_t* a;
  const uint32_t* b;
  uint32_t* sum;
  uint32_t* product;
  int64_t n;
  bool half;
};
cudaError_t launch_pair_math(const PairMathArgs& args, cudaStream_t stream);

// Tensor maps edited on the device (grouped / ragged GEMM). CTA g copies `map_template` (a 2-D
// map over `base`) to workspace[g], replaces its global address, dims and row stride with
// group g's (groups[g] = element offset, rows, cols, row stride in elements), publishes it with
// the tensormap proxy fences, TMA-loads the box at (0, 0) through it and dumps the
// shared-memory image to images[g] (box_bytes each).
struct TensormapReplaceArgs {
  const CUtensorMap* map_template;
  const uint8_t* base;
  uint32_t element_bytes;
  const int32_t* groups;  // [num_groups, 4]
  int num_groups;
  CUtensorMap* workspace;  // [num_groups], 64-byte aligned
  uint32_t box_bytes;
  uint8_t* images;
  int32_t* timeouts;
  uint64_t timeout_cycles;
};
cudaError_t launch_tensormap_replace(const TensormapReplaceArgs& args, cudaStream_t stream);

// One producer warp copies `bytes` of `src` chunk by chunk through a PipelineCpAsync ring
// (cp.async, the tail of the last chunk zero-filled) to `consumers` warps, which write each
// chunk to dst (chunks * kCpAsyncChunkBytes bytes). `full_arrivals` is the full barriers'
// count: 32 (the producer threads) is right; anything else must time out.
constexpr uint32_t kCpAsyncChunkBytes = 2 * 32 * 16;  // two 16-byte copies per producer lane
struct CpAsyncPipelineArgs {
  int stages;  // 2 or 4
  int consumers;
  const uint8_t* src;
  uint64_t bytes;
  uint8_t* dst;
  uint32_t full_arrivals;
  int32_t* timeouts;
  uint64_t timeout_cycles;
};
cudaError_t launch_cp_async_pipeline(const CpAsyncPipelineArgs& args, cudaStream_t stream);

// Distributed shared memory: one cluster of `cluster_size` CTAs; CTA r st.async-stores
// src[r] (words 32-bit words) into the inbox of CTA (r + 1) % size, completing on that CTA's
// mbarrier, which expects words * 4 + extra_tx_bytes. Every CTA dumps its inbox to dst[r].
struct DsmemRingArgs {
  int cluster_size;  // 2 or 4
  const uint32_t* src;  // [cluster_size, words]
  int words;
  uint32_t extra_tx_bytes;
  uint32_t* dst;  // [cluster_size, words]
  int32_t* timeouts;
  uint64_t timeout_cycles;
};
cudaError_t launch_dsmem_ring(const DsmemRingArgs& args, cudaStream_t stream);

// PipelineTmaAsync across a cluster of `cluster_size` CTAs. At iteration k CTA r TMA-loads
// slice r of x tile k and multicasts it to every CTA, and loads its own y tile (r, k); its full
// barrier expects the whole x tile plus the y tile. `consumers` warps per CTA copy the stage to
// out[r, k] and release it in every CTA (empty barriers count consumers * cluster_size +
// extra_empty_arrivals). CTA slow_cta's consumers sleep before reading. After its producer tail
// each producer stores releases[r] (the releases targeted at CTA r so far) to tail_releases[r].
struct TmaMulticastPipelineArgs {
  const CUtensorMap* map_x;  // [iterations * cluster_size * slice_rows, cols], box slice rows
  const CUtensorMap* map_y;  // [cluster_size * iterations * y_rows, cols], box y rows
  int stages;                // 2, 3 or 4
  int cluster_size;          // 2 or 4
  int consumers;             // 1 or 2
  int iterations;
  int slice_rows;
  int y_rows;
  uint32_t slice_bytes;
  uint32_t y_bytes;
  int slow_cta;
  uint32_t extra_empty_arrivals;
  uint8_t* out;              // [cluster_size, iterations, stage bytes]
  int32_t* releases;         // [cluster_size], zeroed before launch
  int32_t* tail_releases;    // [cluster_size]
  int32_t* timeouts;
  uint64_t timeout_cycles;
};
cudaError_t launch_tma_multicast_pipeline(const TmaMulticastPipelineArgs& args,
                                          cudaStream_t stream);

// PipelineTmaStore: four warps fill a ring of `stages` tiles of kStoreTileRows x kStoreTileCols
// int32 with store_pipeline_value(k, i); one thread TMA-stores buffer k to tile k of `map_out`.
constexpr int kStoreTileRows = 32;
constexpr int kStoreTileCols = 32;
__host__ __device__ constexpr int32_t store_pipeline_value(int tile, int element) {
  return tile * 65536 + element;
}
struct TmaStorePipelineArgs {
  const CUtensorMap* map_out;  // int32 [iterations * kStoreTileRows, kStoreTileCols]
  int stages;                  // 2 or 4
  int iterations;
};
cudaError_t launch_tma_store_pipeline(const TmaStorePipelineArgs& args, cudaStream_t stream);

// Two warpgroups hand a double buffer back and forth through named barriers; at iteration k
// warpgroup k % 2 writes ping_pong_value(k, t) into slot t, the other one records slot
// (t + 37 + k) % 128 in seen[k, t].
__host__ __device__ constexpr int32_t ping_pong_value(int iteration, int slot) {
  return iteration * 1000 + slot;
}
struct NamedBarrierArgs {
  int iterations;
  int32_t* seen;  // [iterations, 128]
};
cudaError_t launch_named_barrier_ping_pong(const NamedBarrierArgs& args, cudaStream_t stream);

// OrderedBarrier<groups, 2>: each group (one warp) passes `passes` times through sections 0 and
// 1; inside section d it reads counters[d], waits, appends its group id to log[d] at that
// position and writes counters[d] + 1 back (deliberately not atomic).
struct OrderedBarrierArgs {
  int groups;  // 2 or 3
  int passes;
  int32_t* counters;  // [2]
  int32_t* log;       // [2, groups * passes]
  int32_t* timeouts;
  uint64_t timeout_cycles;
};
cudaError_t launch_ordered_barrier(const OrderedBarrierArgs& args, cudaStream_t stream);

}  // namespace jax_tma::testing
