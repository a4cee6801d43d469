// Test kernels for the TMA, mbarrier, cluster and pipeline primitives and the epilogues' packed
// arithmetic (see primitives_test.h). Each kernel exercises one primitive the way the GEMM uses
// it and reports timeouts through bounded waits instead of hanging.
#include <algorithm>

#include "epilogue/tma_store.cuh"
#include "pipeline/async_pipeline.cuh"
#include "pipeline/barrier_wait.cuh"
#include "ptx/cluster.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/tma.cuh"
#include "testing/kernel_util.cuh"
#include "testing/primitives_test.h"

namespace jax_tma::testing {
namespace {

constexpr int kThreads = 128;

struct BoxParams {
  int box_counts[5];
  int box[5];
  uint32_t box_bytes;
  uint8_t* images;
  int32_t* timeouts;
  uint64_t timeout_cycles;
};

template <int kRank>
__device__ ptx::TmaCoord<kRank> box_corner(const BoxParams& p) {
  ptx::TmaCoord<kRank> coord;
  int linear = blockIdx.x;
#pragma unroll
  for (int i = 0; i < kRank; ++i) {
    coord.c[i] = (linear % p.box_counts[i]) * p.box[i];
    linear /= p.box_counts[i];
  }
  return coord;
}

// Every thread: thread 0 sets up `bar` and TMA-loads the box at `corner` into `buf`, then all
// threads wait for it. False (the timeout counted once) if it did not land in time.
template <int kRank>
__device__ bool load_one_box(uint8_t* buf, uint64_t* bar, const CUtensorMap* map,
                             const ptx::TmaCoord<kRank>& corner, const BoxParams& p) {
  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(map);
    ptx::mbarrier_init(bar, 1);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(bar, p.box_bytes);
    ptx::tma_load(buf, map, bar, corner);
  }
  if (wait_parity_bounded(bar, 0, p.timeout_cycles)) return true;
  if (threadIdx.x == 0) report_timeout(p.timeouts);
  return false;
}

// One box per CTA: TMA load -> dump the shared-memory image -> TMA store.
template <int kRank>
__global__ void tma_round_trip_kernel(const __grid_constant__ CUtensorMap map_in,
                                      const __grid_constant__ CUtensorMap map_out, BoxParams p) {
  extern __shared__ uint8_t raw[];
  uint8_t* buf = align_1024(raw);
  __shared__ uint64_t bar;
  const auto corner = box_corner<kRank>(p);
  if (!load_one_box(buf, &bar, &map_in, corner, p)) return;
  dump_smem(p.images + static_cast<size_t>(blockIdx.x) * p.box_bytes, buf, p.box_bytes);
  if (threadIdx.x == 0) {
    ptx::tma_store(&map_out, buf, corner);
    ptx::tma_store_commit_group();
    ptx::tma_store_wait_all<0>();
  }
}

// One box per CTA: TMA load of x, then a TMA reduce-add of it into y.
__global__ void tma_reduce_add_kernel(const __grid_constant__ CUtensorMap map_x,
                                      const __grid_constant__ CUtensorMap map_y, BoxParams p) {
  extern __shared__ uint8_t raw[];
  uint8_t* buf = align_1024(raw);
  __shared__ uint64_t bar;
  const auto corner = box_corner<2>(p);
  if (!load_one_box(buf, &bar, &map_x, corner, p)) return;
  if (threadIdx.x == 0) {
    ptx::tma_reduce_add_2d(&map_y, buf, corner.c[0], corner.c[1]);
    ptx::tma_store_commit_group();
    ptx::tma_store_wait_all<0>();
  }
}

struct MulticastParams {
  int cluster_m;
  int cluster_n;
  uint32_t issuers;
  uint32_t mask;
  int mode;
  uint32_t extra_tx_bytes;
  uint32_t box_bytes;
  int box_rows;
  uint8_t* images;
  int32_t* timeouts;
  uint64_t timeout_cycles;
};

__device__ uint16_t multicast_mask_of(const MulticastParams& p, uint32_t issuer) {
  if (p.mode == 1) return ptx::multicast_mask_same_n(p.cluster_m, issuer / p.cluster_m);
  if (p.mode == 2) return ptx::multicast_mask_same_m(p.cluster_m, p.cluster_n, issuer % p.cluster_m);
  return static_cast<uint16_t>(p.mask);
}

__global__ void tma_multicast_kernel(const __grid_constant__ CUtensorMap map_x,
                                     MulticastParams p) {
  extern __shared__ uint8_t raw[];
  uint8_t* slots = align_1024(raw);
  __shared__ uint64_t bar;
  const uint32_t rank = ptx::cluster_cta_rank();
  const uint32_t size = ptx::cluster_num_ctas();
  for (uint32_t i = threadIdx.x * 16; i < size * p.box_bytes; i += blockDim.x * 16) {
    *reinterpret_cast<uint4*>(slots + i) = make_uint4(0xA5A5A5A5u, 0xA5A5A5A5u, 0xA5A5A5A5u,
                                                      0xA5A5A5A5u);
  }
  // NOTE: the sentinel is written by the generic proxy and overwritten by TMA (async proxy).
  ptx::fence_proxy_async_shared();
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(&bar, 1);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  // Every CTA's barrier is initialised before any peer multicasts into it.
  ptx::cluster_sync();
  if (threadIdx.x == 0) {
    uint32_t expected = p.extra_tx_bytes;
    for (uint32_t i = 0; i < size; ++i) {
      if ((p.issuers >> i & 1u) && (multicast_mask_of(p, i) >> rank & 1u)) expected += p.box_bytes;
    }
    ptx::mbarrier_arrive_expect_tx(&bar, expected);
    if (p.issuers >> rank & 1u) {
      ptx::tma_load_2d_multicast(slots + rank * p.box_bytes, &map_x, &bar,
                                 multicast_mask_of(p, rank), 0,
                                 static_cast<int32_t>(rank) * p.box_rows);
    }
  }
  if (!wait_parity_bounded(&bar, 0, p.timeout_cycles) && threadIdx.x == 0) {
    p.timeouts[rank] = 1;
  }
  __syncthreads();
  dump_smem(p.images + static_cast<size_t>(rank) * size * p.box_bytes, slots, size * p.box_bytes);
  // No CTA may exit while a peer can still multicast into it.
  cluster_sync_all();
}

struct PhaseParams {
  int consumers;
  int iterations;
  int32_t* seen;
  int32_t* timeouts;
  uint64_t timeout_cycles;
};

__host__ __device__ constexpr int32_t phase_test_value(int iteration) { return iteration * 7 + 3; }

template <int kStages>
__global__ void pipeline_phases_kernel(PhaseParams p) {
  using Pipeline = PipelineAsync<kStages>;
  __shared__ typename Pipeline::SharedStorage barriers;
  __shared__ int32_t data[kStages];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    Pipeline::init(barriers, 1, p.consumers);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  Pipeline pipeline{barriers};
  if (threadIdx.x % 32 != 0) return;
  volatile int32_t* slots = data;
  if (warp == 0) {
    auto write = make_producer_start_state<kStages>();
    for (int it = 0; it < p.iterations; ++it, ++write) {
      if (!pipeline.producer_acquire_bounded(write, p.timeout_cycles)) {
        report_timeout(p.timeouts);
        return;
      }
      slots[write.index] = phase_test_value(it);
      pipeline.producer_commit(write);
    }
  } else {
    const int consumer = warp - 1;
    auto read = make_consumer_start_state<kStages>();
    for (int it = 0; it < p.iterations; ++it, ++read) {
      if (!pipeline.consumer_wait_bounded(read, p.timeout_cycles)) {
        report_timeout(p.timeouts);
        return;
      }
      p.seen[consumer * p.iterations + it] = slots[read.index];
      pipeline.consumer_release(read);
    }
  }
}

template <class Out>
__global__ void pair_math_kernel(const uint32_t* a, const uint32_t* b, uint32_t* sum,
                                 uint32_t* product, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    sum[i] = add_pairs<Out>(a[i], b[i]);
    product[i] = mul_pairs<Out>(a[i], b[i]);
  }
}

BoxParams box_params(const int* counts, const int* box, int rank, uint32_t box_bytes,
                     uint8_t* images, int32_t* timeouts, uint64_t timeout_cycles) {
  BoxParams p{};
  for (int i = 0; i < 5; ++i) {
    p.box_counts[i] = i < rank ? counts[i] : 1;
    p.box[i] = i < rank ? box[i] : 1;
  }
  p.box_bytes = box_bytes;
  p.images = images;
  p.timeouts = timeouts;
  p.timeout_cycles = timeout_cycles;
  return p;
}

int total_boxes(const int* counts, int rank) {
  int n = 1;
  for (int i = 0; i < rank; ++i) n *= counts[i];
  return n;
}

}  // namespace

cudaError_t launch_tma_round_trip(const RoundTripArgs& a, cudaStream_t stream) {
  const BoxParams p = box_params(a.box_counts, a.box, a.rank, a.box_bytes, a.images, a.timeouts,
                                 a.timeout_cycles);
  const int blocks = total_boxes(a.box_counts, a.rank);
  const uint32_t smem = a.box_bytes + 1024;
  switch (a.rank) {
    case 1: return launch_plain(tma_round_trip_kernel<1>, blocks, kThreads, smem, stream, *a.map_in, *a.map_out, p);
    case 2: return launch_plain(tma_round_trip_kernel<2>, blocks, kThreads, smem, stream, *a.map_in, *a.map_out, p);
    case 3: return launch_plain(tma_round_trip_kernel<3>, blocks, kThreads, smem, stream, *a.map_in, *a.map_out, p);
    case 4: return launch_plain(tma_round_trip_kernel<4>, blocks, kThreads, smem, stream, *a.map_in, *a.map_out, p);
    case 5: return launch_plain(tma_round_trip_kernel<5>, blocks, kThreads, smem, stream, *a.map_in, *a.map_out, p);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_tma_reduce_add(const ReduceAddArgs& a, cudaStream_t stream) {
  const BoxParams p =
      box_params(a.box_counts, a.box, 2, a.box_bytes, nullptr, a.timeouts, a.timeout_cycles);
  return launch_plain(tma_reduce_add_kernel, total_boxes(a.box_counts, 2), 32, a.box_bytes + 1024,
                      stream, *a.map_x, *a.map_y, p);
}

cudaError_t launch_tma_multicast(const MulticastArgs& a, cudaStream_t stream) {
  const int size = a.cluster_m * a.cluster_n;
  const MulticastParams p{a.cluster_m,      a.cluster_n, a.issuers,   a.mask,
                          a.mode,           a.extra_tx_bytes,        a.box_bytes,
                          a.box_rows,       a.images,    a.timeouts,  a.timeout_cycles};
  const uint32_t smem = size * a.box_bytes + 1024;
  return launch_one_cluster(tma_multicast_kernel, a.cluster_m, a.cluster_n, kThreads, smem, stream,
                            *a.map_x, p);
}

cudaError_t launch_pipeline_phases(const PhaseArgs& a, cudaStream_t stream) {
  PhaseParams p{a.consumers, a.iterations, a.seen, a.timeouts, a.timeout_cycles};
  const int threads = 32 * (1 + a.consumers);
  if (a.stages == 2) return launch_plain(pipeline_phases_kernel<2>, 1, threads, 0, stream, p);
  if (a.stages == 4) return launch_plain(pipeline_phases_kernel<4>, 1, threads, 0, stream, p);
  return cudaErrorInvalidValue;
}

cudaError_t launch_pair_math(const PairMathArgs& a, cudaStream_t stream) {
  if (a.n == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>((a.n + 255) / 256, 1024));
  if (a.half) {
    return launch_plain(pair_math_kernel<__half>, blocks, 256, 0, stream, a.a, a.b, a.sum,
                        a.product, a.n);
  }
  return launch_plain(pair_math_kernel<__nv_bfloat16>, blocks, 256, 0, stream, a.a, a.b, a.sum,
                      a.product, a.n);
}

}  // namespace jax_tma::testing
