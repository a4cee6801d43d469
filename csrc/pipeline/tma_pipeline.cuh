// PipelineTmaAsync: a ring of kStages buffers filled by TMA and drained by consumer warps.
//
// full[s]  completes when the producer has armed it (one arrive with the stage's byte count)
//          and the copies have landed those bytes.
// empty[s] completes when every consumer warp has released the stage.
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
  // before any other thread uses them.
  __device__ static void init(SharedStorage& s, uint32_t consumer_arrivals) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      ptx::mbarrier_init(&s.full[i], 1);
      ptx::mbarrier_init(&s.empty[i], consumer_arrivals);
    }
  }

  // Producer: block until the consumers have released the stage.
  __device__ void producer_acquire(const State& s) { wait_parity(&storage.empty[s.index], s.phase); }

  // Producer: arm the full barrier with the stage's byte count; returns it for the copies.
  __device__ uint64_t* producer_expect_tx(const State& s, uint32_t bytes) {
    ptx::mbarrier_arrive_expect_tx(&storage.full[s.index], bytes);
    return &storage.full[s.index];
  }

  // Producer, before exit: wait until every stage it filled has been released, so no copy
  // or consumer arrival targets shared memory of a CTA that has finished.
  __device__ void producer_tail(State s) {
#pragma unroll 1
    for (int i = 0; i < kStages; ++i) {
      producer_acquire(s);
      ++s;
    }
  }

  // Consumer: block until the stage's bytes have landed.
  __device__ void consumer_wait(const State& s) { wait_parity(&storage.full[s.index], s.phase); }

  // Consumer: one arrival on the stage's empty barrier.
  __device__ void consumer_release(const State& s) {
    ptx::mbarrier_arrive(&storage.empty[s.index]);
  }
};

}  // namespace jax_tma
