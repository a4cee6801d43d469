// Test kernels of the pipelines in csrc/pipeline/: PipelineCpAsync (cp.async ring),
// PipelineTmaAsync across a cluster (multicast-aware empty signalling, producer tail) and
// PipelineTmaStore (ring of TMA-store buffers). See primitives_test.h for each protocol.
#include "pipeline/barrier_wait.cuh"
#include "pipeline/cp_async_pipeline.cuh"
#include "pipeline/named_barrier.cuh"
#include "pipeline/pipeline_state.cuh"
#include "pipeline/tma_pipeline.cuh"
#include "pipeline/tma_store_pipeline.cuh"
#include "ptx/cluster.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/tma.cuh"
#include "testing/kernel_util.cuh"
#include "testing/primitives_test.h"

namespace jax_tma::testing {
namespace {

constexpr uint32_t kAllLanes = 0xffffffffu;

// A whole warp agrees on a bounded wait's outcome, so no lane runs on while another gave up.
__device__ __forceinline__ bool warp_all(bool ok) { return __all_sync(kAllLanes, ok); }

// ---------------------------------------------------------------- PipelineCpAsync

constexpr uint32_t kCpAsyncPieces = kCpAsyncChunkBytes / 16;

template <int kStages>
struct CpAsyncRing {
  PipelineCpAsync<kStages> pipeline;
  uint8_t (*chunks)[kCpAsyncChunkBytes];
};

// Producer warp: 16-byte cp.async per lane and piece; pieces past the end read nothing and
// zero-fill, the one straddling the end reads only its valid bytes.
template <int kStages>
__device__ bool cp_async_produce(CpAsyncRing<kStages>& ring, const CpAsyncPipelineArgs& a,
                                 uint32_t num_chunks) {
  const uint32_t lane = threadIdx.x % 32;
  auto write = make_producer_start_state<kStages>();
  for (uint32_t c = 0; c < num_chunks; ++c, ++write) {
    if (!ring.pipeline.producer_acquire_bounded(write, a.timeout_cycles)) return false;
    for (uint32_t piece = lane; piece < kCpAsyncPieces; piece += 32) {
      const uint64_t offset = uint64_t{c} * kCpAsyncChunkBytes + piece * 16;
      const uint64_t left = offset < a.bytes ? a.bytes - offset : 0;
      const uint32_t src_bytes = left < 16 ? static_cast<uint32_t>(left) : 16u;
      ptx::cp_async_16(ring.chunks[write.index] + piece * 16, a.src + (src_bytes ? offset : 0),
                       src_bytes);
    }
    ring.pipeline.producer_commit(write);
  }
  return ring.pipeline.producer_tail_bounded(write, a.timeout_cycles);
}

// Consumer warp `consumer`: copies its share of each chunk to dst, then releases the stage.
template <int kStages>
__device__ bool cp_async_consume(CpAsyncRing<kStages>& ring, const CpAsyncPipelineArgs& a,
                                 uint32_t num_chunks, int consumer) {
  const uint32_t lane = threadIdx.x % 32;
  auto read = make_consumer_start_state<kStages>();
  for (uint32_t c = 0; c < num_chunks; ++c, ++read) {
    if (!warp_all(ring.pipeline.consumer_wait_bounded(read, a.timeout_cycles))) return false;
    for (uint32_t piece = consumer * 32 + lane; piece < kCpAsyncPieces; piece += a.consumers * 32) {
      *reinterpret_cast<uint4*>(a.dst + uint64_t{c} * kCpAsyncChunkBytes + piece * 16) =
          *reinterpret_cast<const uint4*>(ring.chunks[read.index] + piece * 16);
    }
    __syncwarp();
    if (lane == 0) ring.pipeline.consumer_release(read);
  }
  return true;
}

template <int kStages>
__global__ void cp_async_pipeline_kernel(CpAsyncPipelineArgs a) {
  using Pipeline = PipelineCpAsync<kStages>;
  __shared__ typename Pipeline::SharedStorage barriers;
  __shared__ alignas(128) uint8_t chunks[kStages][kCpAsyncChunkBytes];
  if (threadIdx.x == 0) {
    Pipeline::init(barriers, a.full_arrivals, a.consumers);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  CpAsyncRing<kStages> ring{Pipeline{barriers}, chunks};
  const uint32_t num_chunks =
      static_cast<uint32_t>((a.bytes + kCpAsyncChunkBytes - 1) / kCpAsyncChunkBytes);
  const int warp = threadIdx.x / 32;
  bool ok;
  if (warp == 0) {
    ok = warp_all(cp_async_produce(ring, a, num_chunks));
    // NOTE: a producer that gave up may still have copies in flight into this CTA.
    ptx::cp_async_commit_group();
    ptx::cp_async_wait_group<0>();
  } else {
    ok = cp_async_consume(ring, a, num_chunks, warp - 1);
  }
  if (!ok && threadIdx.x % 32 == 0) report_timeout(a.timeouts);
}

// ------------------------------------------------- PipelineTmaAsync across a cluster

constexpr unsigned kSlowConsumerNs = 2000;

template <int kStages>
struct MulticastRing {
  PipelineTmaAsync<kStages> pipeline;
  uint8_t* stages;
  uint32_t stage_bytes;
  uint32_t x_bytes;  // the shared tile: cluster_size slices
  uint32_t rank;
  uint16_t all_ctas;

  __device__ uint8_t* stage(uint32_t index) const { return stages + index * stage_bytes; }
};

// Producer thread: slice `rank` of x tile k goes to every CTA, y tile (rank, k) only here.
// After the tail, every release aimed at this CTA has happened: record how many there were.
template <int kStages>
__device__ bool multicast_produce(MulticastRing<kStages>& ring, const CUtensorMap* map_x,
                                  const CUtensorMap* map_y, const TmaMulticastPipelineArgs& a) {
  auto write = make_producer_start_state<kStages>();
  for (int k = 0; k < a.iterations; ++k, ++write) {
    if (!ring.pipeline.producer_acquire_bounded(write, a.timeout_cycles)) return false;
    uint8_t* stage = ring.stage(write.index);
    uint64_t* full = ring.pipeline.producer_expect_tx(write, ring.x_bytes + a.y_bytes);
    const int rank = static_cast<int>(ring.rank);
    ptx::tma_load_2d_multicast(stage + rank * a.slice_bytes, map_x, full, ring.all_ctas, 0,
                               (k * a.cluster_size + rank) * a.slice_rows);
    ptx::tma_load_2d(stage + ring.x_bytes, map_y, full, 0, (rank * a.iterations + k) * a.y_rows);
  }
  if (!ring.pipeline.producer_tail_bounded(write, a.timeout_cycles)) return false;
  a.tail_releases[ring.rank] = atomicAdd(&a.releases[ring.rank], 0);
  return true;
}

// Consumer warp: copies its share of every stage to out[rank, k], counts the releases it is
// about to send, then releases the stage in every CTA (whose producers all wrote into it).
template <int kStages>
__device__ bool multicast_consume(MulticastRing<kStages>& ring, const TmaMulticastPipelineArgs& a,
                                  int consumer) {
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t pieces = ring.stage_bytes / 16;
  auto read = make_consumer_start_state<kStages>();
  for (int k = 0; k < a.iterations; ++k, ++read) {
    if (!warp_all(ring.pipeline.consumer_wait_bounded(read, a.timeout_cycles))) return false;
    // NOTE: holding the stage longer in one CTA is what exposes a producer that refills it
    // after only its own CTA's consumers released it.
    if (static_cast<int>(ring.rank) == a.slow_cta) __nanosleep(kSlowConsumerNs);
    const uint8_t* stage = ring.stage(read.index);
    uint8_t* out = a.out + (static_cast<size_t>(ring.rank) * a.iterations + k) * ring.stage_bytes;
    for (uint32_t piece = consumer * 32 + lane; piece < pieces; piece += a.consumers * 32) {
      *reinterpret_cast<uint4*>(out + piece * 16) =
          *reinterpret_cast<const uint4*>(stage + piece * 16);
    }
    if (lane < static_cast<uint32_t>(a.cluster_size)) atomicAdd(&a.releases[lane], 1);
    ring.pipeline.consumer_release_cluster(read, ring.all_ctas);
  }
  return true;
}

template <int kStages>
__global__ void tma_multicast_pipeline_kernel(const __grid_constant__ CUtensorMap map_x,
                                              const __grid_constant__ CUtensorMap map_y,
                                              TmaMulticastPipelineArgs a) {
  using Pipeline = PipelineTmaAsync<kStages>;
  extern __shared__ uint8_t raw[];
  __shared__ typename Pipeline::SharedStorage barriers;
  const uint32_t x_bytes = a.cluster_size * a.slice_bytes;
  MulticastRing<kStages> ring{Pipeline{barriers},
                              align_1024(raw),
                              x_bytes + a.y_bytes,
                              x_bytes,
                              ptx::cluster_cta_rank(),
                              static_cast<uint16_t>((1u << a.cluster_size) - 1)};
  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&map_x);
    ptx::prefetch_tensormap(&map_y);
    Pipeline::init(barriers, a.consumers * a.cluster_size + a.extra_empty_arrivals);
    ptx::fence_mbarrier_init();
  }
  // Every CTA's barriers exist before a peer multicasts into it or arrives on them.
  cluster_sync_all();
  const int warp = threadIdx.x / 32;
  if (warp == 0) {
    if (threadIdx.x == 0 && !multicast_produce(ring, &map_x, &map_y, a)) {
      report_timeout(a.timeouts);
    }
  } else if (!multicast_consume(ring, a, warp - 1) && threadIdx.x % 32 == 0) {
    report_timeout(a.timeouts);
  }
  // No CTA exits while a peer may still multicast into it or arrive on its barriers.
  cluster_sync_all();
}

// ---------------------------------------------------------------- PipelineTmaStore

constexpr int kStoreWarps = 4;
constexpr int kStoreTileElements = kStoreTileRows * kStoreTileCols;

template <int kStages>
__global__ void tma_store_pipeline_kernel(const __grid_constant__ CUtensorMap map_out,
                                          int iterations) {
  using Pipeline = PipelineTmaStore<kStages>;
  __shared__ alignas(1024) int32_t buffers[kStages][kStoreTileElements];
  const NamedBarrier writers{static_cast<uint32_t>(NamedBarrierId::kFirstFree), kStoreWarps * 32};
  const bool issuer = threadIdx.x == 0;
  typename Pipeline::State state;
  for (int k = 0; k < iterations; ++k, ++state) {
    if (issuer) Pipeline::producer_acquire();
    writers.sync();  // the buffer's previous store has read it
    int32_t* buffer = buffers[state.index];
    for (int i = threadIdx.x; i < kStoreTileElements; i += blockDim.x) {
      buffer[i] = store_pipeline_value(k, i);
    }
    ptx::fence_proxy_async_shared();
    writers.sync();  // the whole tile is visible to the TMA unit
    if (issuer) {
      ptx::tma_store_2d(&map_out, buffer, 0, k * kStoreTileRows);
      Pipeline::producer_commit();
    }
  }
  if (issuer) Pipeline::producer_tail();
}

}  // namespace

cudaError_t launch_cp_async_pipeline(const CpAsyncPipelineArgs& a, cudaStream_t stream) {
  const int threads = 32 * (1 + a.consumers);
  if (a.stages == 2) return launch_plain(cp_async_pipeline_kernel<2>, 1, threads, 0, stream, a);
  if (a.stages == 4) return launch_plain(cp_async_pipeline_kernel<4>, 1, threads, 0, stream, a);
  return cudaErrorInvalidValue;
}

cudaError_t launch_tma_multicast_pipeline(const TmaMulticastPipelineArgs& a,
                                          cudaStream_t stream) {
  const int threads = 32 * (1 + a.consumers);
  const uint32_t stage_bytes = a.cluster_size * a.slice_bytes + a.y_bytes;
  const uint32_t smem = a.stages * stage_bytes + 1024;
  auto launch = [&](auto kernel) {
    return launch_one_cluster(kernel, a.cluster_size, 1, threads, smem, stream, *a.map_x, *a.map_y,
                              a);
  };
  switch (a.stages) {
    case 2: return launch(tma_multicast_pipeline_kernel<2>);
    case 3: return launch(tma_multicast_pipeline_kernel<3>);
    case 4: return launch(tma_multicast_pipeline_kernel<4>);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_tma_store_pipeline(const TmaStorePipelineArgs& a, cudaStream_t stream) {
  const int threads = kStoreWarps * 32;
  if (a.stages == 2) {
    return launch_plain(tma_store_pipeline_kernel<2>, 1, threads, 0, stream, *a.map_out,
                        a.iterations);
  }
  if (a.stages == 4) {
    return launch_plain(tma_store_pipeline_kernel<4>, 1, threads, 0, stream, *a.map_out,
                        a.iterations);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_tma::testing
