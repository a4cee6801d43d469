// The prepare kernel of the grouped (ragged) products; see sm90_ragged_prepare.cuh.
#include "kernels/sm90_ragged_prepare.cuh"

#include "ptx/tensormap.cuh"

namespace jax_tma::sm90_gemm {
namespace {

inline constexpr int kPrepareThreads = 1024;

// Exclusive prefix sum of `v` over the CTA (kPrepareThreads threads); *total gets the sum.
// `warp_sums` holds 32 values in shared memory.
__device__ inline int64_t cta_exclusive_scan(int64_t v, int64_t* warp_sums, int64_t* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int64_t x = v;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int64_t y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t s = warp_sums[lane];
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int64_t y = __shfl_up_sync(0xffffffffu, s, offset);
      if (lane >= offset) s += y;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  const int64_t exclusive = x - v + (warp > 0 ? warp_sums[warp - 1] : 0);
  *total = warp_sums[31];
  __syncthreads();  // warp_sums is rewritten by the next scan
  return exclusive;
}

// Segment s's maps: the templates moved to its first row, cut to its rows (at least 1: a map
// has no empty dimension, and an empty segment's map is never used).
__device__ inline void write_segment_maps(const RaggedPrepareParams& p,
                                          const RaggedTemplates& templates, int s,
                                          int64_t first_row, int rows) {
#pragma unroll
  for (int i = 0; i < kRaggedMaxMapsPerSegment; ++i) {
    if (i == p.maps_per_segment) break;
    CUtensorMap* map = p.maps + static_cast<int64_t>(s) * p.maps_per_segment + i;
    ptx::tensormap_copy(map, &templates.maps[i]);
    ptx::tensormap_replace_global_address(map, p.bases[i] + first_row * p.row_bytes[i]);
    ptx::tensormap_replace_global_dim<1>(map, static_cast<uint32_t>(max(rows, 1)));
  }
  ptx::fence_tensormap_release();
}

__global__ void __launch_bounds__(kPrepareThreads, 1)
    sm90_ragged_prepare_kernel(const __grid_constant__ RaggedTemplates templates,
                               RaggedPrepareParams p) {
  __shared__ int64_t warp_sums[32];
  const int per_entry = p.groups + (p.tail ? 1 : 0);
  const auto blocks_of = [&](int64_t rows) -> int64_t {
    return p.tail ? (rows + p.block_m - 1) / p.block_m : 0;  // rows mode only
  };
  // Up to a multiple of the cluster size (a zero segment's start and length, the end).
  const auto whole_clusters = [&](int64_t blocks) {
    return (blocks + p.cluster_m - 1) / p.cluster_m * p.cluster_m;
  };
  int64_t block_carry = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int32_t* sizes = p.group_sizes + b * p.group_sizes_batch_stride;
    const int64_t entry_row = static_cast<int64_t>(b) * p.rows;
    int64_t row_carry = 0;
    for (int g0 = 0; g0 < p.groups; g0 += kPrepareThreads) {
      const int g = g0 + static_cast<int>(threadIdx.x);
      const bool mine = g < p.groups;
      const int64_t size = mine ? min(max(sizes[g], 0), p.rows) : 0;
      int64_t chunk_rows, chunk_blocks;
      const int64_t before = row_carry + cta_exclusive_scan(size, warp_sums, &chunk_rows);
      const int64_t begin = min(before, int64_t{p.rows});
      const int rows = static_cast<int>(min(before + size, int64_t{p.rows}) - begin);
      const int64_t blocks = mine ? blocks_of(rows) : 0;
      const int64_t first_block =
          block_carry + cta_exclusive_scan(blocks, warp_sums, &chunk_blocks);
      if (mine) {
        const int s = b * per_entry + g;
        const int weight = p.weights_batched ? b * p.groups + g : g;
        p.segments[s] = RaggedSegment{static_cast<int32_t>(entry_row + begin), rows, weight,
                                      static_cast<int32_t>(first_block)};
        write_segment_maps(p, templates, s, entry_row + begin, rows);
      }
      row_carry += chunk_rows;
      block_carry += chunk_blocks;
    }
    if (p.tail) {  // every thread computes the tail; thread 0 writes it
      const int64_t begin = min(row_carry, int64_t{p.rows});
      const int rows = static_cast<int>(p.rows - begin);
      if (rows > 0) block_carry = whole_clusters(block_carry);
      if (threadIdx.x == 0) {
        const int s = b * per_entry + p.groups;
        p.segments[s] = RaggedSegment{static_cast<int32_t>(entry_row + begin), rows, -1,
                                      static_cast<int32_t>(block_carry)};
        write_segment_maps(p, templates, s, entry_row + begin, rows);
      }
      block_carry += whole_clusters(blocks_of(rows));
    }
  }
  if (threadIdx.x == 0) {
    p.segments[p.batch * per_entry] =
        RaggedSegment{static_cast<int32_t>(static_cast<int64_t>(p.batch) * p.rows), 0, -1,
                      static_cast<int32_t>(whole_clusters(block_carry))};
  }
}

}  // namespace

cudaError_t launch_ragged_prepare(const RaggedTemplates& templates,
                                  const RaggedPrepareParams& params, cudaStream_t stream) {
  sm90_ragged_prepare_kernel<<<1, kPrepareThreads, 0, stream>>>(templates, params);
  return cudaGetLastError();
}

}  // namespace jax_tma::sm90_gemm
