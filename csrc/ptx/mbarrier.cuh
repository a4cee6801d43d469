// mbarrier wrappers (PTX ISA "mbarrier"): one function per instruction variant.
// Barriers are 8-byte words in shared memory. Phases, counts and waiting loops are policy and
// live in csrc/pipeline/, not here.
#pragma once

#include <cstdint>

#include "ptx/common.cuh"

namespace jax_tma::ptx {

// mbarrier.init: arrival count for each phase.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals)
               : "memory");
}

// Makes barrier initialisation visible to the async proxy and to peer CTAs of the cluster.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// mbarrier.arrive: one arrival, release semantics at CTA scope.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar))
               : "memory");
}

// mbarrier.arrive.expect_tx: one arrival plus `bytes` of expected transactions.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(
                   smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

// mbarrier.expect_tx: raise the expected transaction count without arriving.
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

// mbarrier.arrive on the barrier at the same offset in CTA `cta_rank` of this cluster.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, uint32_t cta_rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(cta_rank)
      : "memory");
}

// mbarrier.arrive on the barrier at the same offset in CTA `cta_rank`, ordering this thread's
// earlier accesses at CTA scope only (no cluster-wide memory fence, which would cost a
// MEMBAR.ALL.GPU per arrival). Enough to hand back a buffer the thread has finished reading, as
// the pipelines' consumer releases do; use mbarrier_arrive_cluster to publish written data.
__device__ __forceinline__ void mbarrier_arrive_remote(uint64_t* bar, uint32_t cta_rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(cta_rank)
      : "memory");
}

// mbarrier.try_wait.parity: true once the phase with parity `parity` has completed.
// The hardware suspends the thread for a system-dependent time before returning false.
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// mbarrier.try_wait.parity at cluster scope: acquires what peer CTAs released to this barrier.
__device__ __forceinline__ bool mbarrier_try_wait_parity_cluster(uint64_t* bar,
                                                                 uint32_t parity) {
  uint32_t done = 0;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

}  // namespace jax_tma::ptx
