// Thread-block cluster wrappers: rank queries, the cluster barrier, shared-memory address
// mapping into peer CTAs (distributed shared memory), and stores into a peer CTA's shared
// memory that complete on the peer's mbarrier.
#pragma once

#include <cstdint>

#include "ptx/common.cuh"

namespace jax_tma::ptx {

// %cluster_ctarank: this CTA's rank within its cluster.
__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// %cluster_nctarank: number of CTAs in this cluster.
__device__ __forceinline__ uint32_t cluster_num_ctas() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// barrier.cluster.arrive (release): signal this thread's arrival. Has no thread mask: every
// thread of every CTA in the cluster must arrive before the phase completes.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

// barrier.cluster.arrive.relaxed: arrival without ordering prior memory accesses.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

// barrier.cluster.wait (acquire): wait for every thread of the cluster to arrive.
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Full cluster barrier.
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// mapa: the shared::cluster address of the same offset as `smem` in CTA `cta_rank`.
__device__ __forceinline__ uint32_t map_shared_rank(const void* smem, uint32_t cta_rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(smem)),
               "r"(cta_rank));
  return remote;
}

// st.async: 32-bit store into peer shared memory (address from map_shared_rank) that
// completes 4 bytes of transactions on the peer's mbarrier `remote_bar`.
__device__ __forceinline__ void dsmem_store_u32(uint32_t remote_addr, uint32_t value,
                                               uint32_t remote_bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%0], %1, [%2];" ::"r"(
          remote_addr),
      "r"(value), "r"(remote_bar)
      : "memory");
}

// st.async of four 32-bit words (16 bytes) into peer shared memory.
__device__ __forceinline__ void dsmem_store_v4_u32(uint32_t remote_addr, uint4 value,
                                                  uint32_t remote_bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.u32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(remote_addr),
      "r"(value.x), "r"(value.y), "r"(value.z), "r"(value.w), "r"(remote_bar)
      : "memory");
}

}  // namespace jax_tma::ptx
