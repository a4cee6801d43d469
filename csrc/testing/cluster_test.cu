// Test kernel of distributed shared memory (ptx/cluster.cuh): st.async stores into a peer
// CTA's shared memory that complete on the peer's mbarrier. See DsmemRingArgs in
// primitives_test.h.
#include "pipeline/barrier_wait.cuh"
#include "ptx/cluster.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/tma.cuh"
#include "testing/kernel_util.cuh"
#include "testing/primitives_test.h"

namespace jax_tma::testing {
namespace {

constexpr int kThreads = 128;
constexpr uint32_t kSentinel = 0xA5A5A5A5u;

// All threads: `words` words of src into the inbox of CTA `peer`, 16 bytes per st.async where
// four words remain, one word otherwise; each store completes its bytes on the peer's barrier.
__device__ void send_to_peer(const uint32_t* inbox, uint64_t* bar, const uint32_t* src, int words,
                             uint32_t peer) {
  const uint32_t remote_inbox = ptx::map_shared_rank(inbox, peer);
  const uint32_t remote_bar = ptx::map_shared_rank(bar, peer);
  const int vector_words = words / 4 * 4;
  for (int i = threadIdx.x * 4; i < vector_words; i += blockDim.x * 4) {
    const uint4 v = make_uint4(src[i], src[i + 1], src[i + 2], src[i + 3]);
    ptx::dsmem_store_v4_u32(remote_inbox + i * 4, v, remote_bar);
  }
  for (int i = vector_words + threadIdx.x; i < words; i += blockDim.x) {
    ptx::dsmem_store_u32(remote_inbox + i * 4, src[i], remote_bar);
  }
}

__global__ void dsmem_ring_kernel(DsmemRingArgs a) {
  extern __shared__ uint8_t raw[];
  uint32_t* inbox = reinterpret_cast<uint32_t*>(align_1024(raw));
  __shared__ uint64_t bar;
  const uint32_t rank = ptx::cluster_cta_rank();
  const uint32_t peer = (rank + 1) % ptx::cluster_num_ctas();
  for (int i = threadIdx.x; i < a.words; i += blockDim.x) inbox[i] = kSentinel;
  // NOTE: orders the sentinel before the peer's stores whichever proxy st.async writes through.
  ptx::fence_proxy_async_shared();
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(&bar, 1);
    ptx::fence_mbarrier_init();
  }
  // Every CTA's inbox and barrier are ready before any peer stores into them.
  cluster_sync_all();
  // The peer's bytes may land before this arm; the phase still needs this arrival to complete.
  if (threadIdx.x == 0) ptx::mbarrier_arrive_expect_tx(&bar, a.words * 4 + a.extra_tx_bytes);
  send_to_peer(inbox, &bar, a.src + static_cast<size_t>(rank) * a.words, a.words, peer);
  if (!wait_parity_cluster_bounded(&bar, 0, a.timeout_cycles) && threadIdx.x == 0) {
    report_timeout(a.timeouts);
  }
  for (int i = threadIdx.x; i < a.words; i += blockDim.x) {
    a.dst[static_cast<size_t>(rank) * a.words + i] = inbox[i];
  }
  // No CTA exits while a peer's stores into it may still be in flight.
  cluster_sync_all();
}

uint32_t dsmem_ring_smem_bytes(int words) { return static_cast<uint32_t>(words) * 4 + 1024; }

}  // namespace

cudaError_t launch_dsmem_ring(const DsmemRingArgs& a, cudaStream_t stream) {
  return launch_one_cluster(dsmem_ring_kernel, a.cluster_size, 1, kThreads,
                            dsmem_ring_smem_bytes(a.words), stream, a);
}

}  // namespace jax_tma::testing
