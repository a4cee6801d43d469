// The prepare kernel of the grouped (ragged) products (kernels/sm90_ragged_dot.cuh): one CTA
// that turns the group sizes on the device into the segment table and per-segment tensor maps
// in the workspace (scheduler/ragged_scheduler.cuh).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "contract/sm90_ragged_dot.h"
#include "scheduler/ragged_scheduler.cuh"

namespace jax_tma::sm90_gemm {

struct RaggedPrepareParams {
  const int32_t* group_sizes;
  int64_t group_sizes_batch_stride;  // 0: shared by every batch entry
  int groups, batch, rows;
  bool tail;             // rows mode: a zero segment after each entry's groups
  bool weights_batched;  // weight index b * groups + g, else g
  // Rows mode: segments' row blocks of block_m rows, numbered across segments; with clusters
  // of 2, a zero segment with rows starts at an even block and counts an even number, and so
  // does the whole numbering (scheduler/ragged_scheduler.cuh).
  int block_m, cluster_m;
  RaggedSegment* segments;  // segments + 1 entries
  CUtensorMap* maps;        // maps_per_segment per segment
  int maps_per_segment;     // up to kRaggedMaxMapsPerSegment
  const uint8_t* bases[kRaggedMaxMapsPerSegment];
  int64_t row_bytes[kRaggedMaxMapsPerSegment];
};

// The maps each segment's are copied from: templates[i] is read only with more than i maps per
// segment.
struct RaggedTemplates {
  CUtensorMap maps[kRaggedMaxMapsPerSegment];
};

// Launches the prepare kernel on `stream`.
cudaError_t launch_ragged_prepare(const RaggedTemplates& templates,
                                  const RaggedPrepareParams& params, cudaStream_t stream);

}  // namespace jax_tma::sm90_gemm
