// Test kernels of the CTA-internal synchronisation of csrc/pipeline/: NamedBarrier (two
// warpgroups handing a buffer back and forth) and OrderedBarrier (groups taking turns through
// sequenced sections). See primitives_test.h.
#include "pipeline/named_barrier.cuh"
#include "pipeline/ordered_barrier.cuh"
#include "ptx/mbarrier.cuh"
#include "testing/kernel_util.cuh"
#include "testing/primitives_test.h"

namespace jax_tma::testing {
namespace {

constexpr int kSlots = 128;  // one per thread of a warpgroup

// Barriers of the iteration parity p: ready (writer arrives, reader syncs) and done (reader
// arrives, writer syncs). NOTE: alternating ids by parity keeps a thread that arrives on a
// barrier from syncing on the same barrier before that barrier's previous use has completed.
struct PingPongBarriers {
  NamedBarrier ready;
  NamedBarrier done;
};

__device__ PingPongBarriers ping_pong_barriers(int parity) {
  const uint32_t first = static_cast<uint32_t>(NamedBarrierId::kFirstFree);
  return {NamedBarrier{first + parity, 2 * kSlots}, NamedBarrier{first + 2 + parity, 2 * kSlots}};
}

// Warpgroup k % 2 writes buffer k % 2, the other one reads it; roles swap every iteration.
__global__ void named_barrier_ping_pong_kernel(NamedBarrierArgs a) {
  __shared__ int32_t buffers[2][kSlots];
  const int warpgroup = threadIdx.x / kSlots;
  const int t = threadIdx.x % kSlots;
  for (int k = 0; k < a.iterations; ++k) {
    const int parity = k % 2;
    const PingPongBarriers bars = ping_pong_barriers(parity);
    if (warpgroup == parity) {
      buffers[parity][t] = ping_pong_value(k, t);
      bars.ready.arrive();
      bars.done.sync();
    } else {
      bars.ready.sync();
      a.seen[k * kSlots + t] = buffers[parity][(t + 37 + k) % kSlots];
      bars.done.arrive();
    }
  }
}

// Read, wait, write: loses updates and scrambles the log unless the groups really take turns.
__device__ void unordered_append(volatile int32_t* counter, int32_t* log, int group, int pass) {
  const int32_t position = *counter;
  __nanosleep(50 + (group * 37 + pass * 11) % 200);
  log[position] = group;
  *counter = position + 1;
}

template <int kGroups>
__global__ void ordered_barrier_kernel(OrderedBarrierArgs a) {
  constexpr int kSections = 2;
  using Order = OrderedBarrier<kGroups, kSections>;
  __shared__ typename Order::SharedStorage storage;
  __shared__ int32_t counters[kSections];
  if (threadIdx.x == 0) {
    Order::init(storage, 32);  // every lane of the group arrives
    ptx::fence_mbarrier_init();
  }
  if (threadIdx.x < kSections) counters[threadIdx.x] = 0;
  __syncthreads();
  const int group = threadIdx.x / 32;
  const bool leader = threadIdx.x % 32 == 0;
  Order order(storage, group);
  bool ok = true;
  const int entries = kGroups * a.passes;
  for (int pass = 0; pass < a.passes && ok; ++pass) {
    for (int d = 0; d < kSections; ++d) {
      ok = __all_sync(0xffffffffu, order.wait_bounded(a.timeout_cycles));
      if (!ok) break;
      if (leader) unordered_append(&counters[d], a.log + d * entries, group, pass);
      __syncwarp();
      order.arrive();
    }
  }
  if (!ok && leader) report_timeout(a.timeouts);
  __syncthreads();
  if (threadIdx.x < kSections) a.counters[threadIdx.x] = counters[threadIdx.x];
}

}  // namespace

cudaError_t launch_named_barrier_ping_pong(const NamedBarrierArgs& a, cudaStream_t stream) {
  return launch_plain(named_barrier_ping_pong_kernel, 1, 2 * kSlots, 0, stream, a);
}

cudaError_t launch_ordered_barrier(const OrderedBarrierArgs& a, cudaStream_t stream) {
  if (a.groups == 2) return launch_plain(ordered_barrier_kernel<2>, 1, 2 * 32, 0, stream, a);
  if (a.groups == 3) return launch_plain(ordered_barrier_kernel<3>, 1, 3 * 32, 0, stream, a);
  return cudaErrorInvalidValue;
}

}  // namespace jax_tma::testing
