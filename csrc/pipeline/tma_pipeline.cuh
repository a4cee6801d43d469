// PipelineTmaAsync: a ring of kStages buffers filled by TMA (optionally multicast across a
// cluster) and drained by consumer warps.
//
// full[s]  completes when this CTA's producer has armed it (one arrive with the bytes that land
//          in this CTA's stage, whoever issues the copies) and those bytes have landed.
// empty[s] completes when every consumer warp that reads the stage has released it, in every
//          CTA whose stage this CTA's producer writes (multicast-aware): init it with
//          consumer warps per CTA x CTAs in the multicast group, and release with
//          consumer_release_cluster naming the CTAs whose producers write into this stage.
// Only this file and pipeline_state.cuh touch phases and stage indices.
#pragma once

#include <cstdint>

#include "pipeline/barrier_wait.cuh"
#include "pipeline/pipeline_state.cuh"
#include "ptx/mbarrier.cuh"

namespace jax_tma {

template <int kStages>
struct PipelineTmaAsync {
  using State = PipelineState<kStages>;

  struct SharedStorage {
    uint64_t full[kStages];
    uint64_t empty[kStages];
  };

  SharedStorage& storage;

  // One thread initialises; the caller makes the barriers visible (fence + CTA/cluster sync)
  // before any other thread, or any peer CTA, uses them.
  __device__ static void init(SharedStorage& s, uint32_t consumer_arrivals) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      ptx::mbarrier_init(&s.full[i], 1);
      ptx::mbarrier_init(&s.empty[i], consumer_arrivals);
    }
  }

  // Producer: block until the consumers have released the stage.
  __device__ void producer_acquire(const State& s) { wait_parity(&storage.empty[s.index], s.phase); }
  __device__ bool producer_acquire_bounded(const State& s, uint64_t max_cycles) {
    return wait_parity_bounded(&storage.empty[s.index], s.phase, max_cycles);
  }

  // Producer: arm the full barrier with the bytes that will land in this CTA's stage;
  // returns it for the copies.
  __device__ uint64_t* producer_expect_tx(const State& s, uint32_t bytes) {
    ptx::mbarrier_arrive_expect_tx(&storage.full[s.index], bytes);
    return &storage.full[s.index];
  }

  // Producer, before exit: wait until every stage it filled has been released, so no copy,
  // multicast or remote consumer arrival targets shared memory of a CTA that has finished.
  __device__ void producer_tail(State s) {
#pragma unroll 1
    for (int i = 0; i < kStages; ++i) {
      producer_acquire(s);
      ++s;
    }
  }
  __device__ bool producer_tail_bounded(State s, uint64_t max_cycles) {
#pragma unroll 1
    for (int i = 0; i < kStages; ++i) {
      if (!producer_acquire_bounded(s, max_cycles)) return false;
      ++s;
    }
    return true;
  }

  // Consumer: block until the stage's bytes have landed.
  __device__ void consumer_wait(const State& s) { wait_parity(&storage.full[s.index], s.phase); }
  __device__ bool consumer_wait_bounded(const State& s, uint64_t max_cycles) {
    return wait_parity_bounded(&storage.full[s.index], s.phase, max_cycles);
  }

  // Consumer (one thread per consumer warp): one arrival on this CTA's empty barrier.
  __device__ void consumer_release(const State& s) {
    ptx::mbarrier_arrive(&storage.empty[s.index]);
  }

  // Consumer, called by all 32 lanes of a consumer warp after the warp's reads of the stage:
  // one arrival on the empty barrier of every CTA in `cta_mask` (bit r = cluster rank r), i.e.
  // every CTA whose producer writes into this CTA's stage. Lane r signals CTA r.
  __device__ void consumer_release_cluster(const State& s, uint32_t cta_mask) {
    const uint32_t lane = threadIdx.x % 32;
    __syncwarp();
    if (lane < 16 && (cta_mask >> lane & 1u)) {
      ptx::mbarrier_arrive_remote(&storage.empty[s.index], lane);
    }
  }
};

}  // namespace jax_tma
