// Purpose-built kernels that prove the PTX and pipeline primitives on the GPU, one launcher per
// test. Only the jax_tma._testing FFI targets (ffi/testing.cc) call these.
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

}  // namespace jax_tma::testing
