// PipelineAsync: a ring of kStages buffers filled by ordinary stores (or any producer that
// signals with plain arrivals) and drained by one or more consumers.
//
// full[s]  completes after `producer_arrivals` arrivals (producer_commit).
// empty[s] completes after `consumer_arrivals` arrivals (consumer_release), e.g. one per
//          consumer warp of every consumer warpgroup for a multi-consumer ring.
// Arrive has release and try_wait acquire semantics at CTA scope, so data written before
// producer_commit is visible to a consumer once consumer_wait returns.
#pragma once

#include <cstdint>

#include "pipeline/barrier_wait.cuh"
#include "pipeline/pipeline_state.cuh"
#include "ptx/mbarrier.cuh"

namespace jax_tma {

template <int kStages>
struct PipelineAsync {
  using State = PipelineState<kStages>;

  struct SharedStorage {
    uint64_t full[kStages];
    uint64_t empty[kStages];
  };

  SharedStorage& storage;

  __device__ static void init(SharedStorage& s, uint32_t producer_arrivals,
                              uint32_t consumer_arrivals) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      ptx::mbarrier_init(&s.full[i], producer_arrivals);
      ptx::mbarrier_init(&s.empty[i], consumer_arrivals);
    }
  }

  __device__ void producer_acquire(const State& s) { wait_parity(&storage.empty[s.index], s.phase); }
  __device__ bool producer_acquire_bounded(const State& s, uint64_t max_cycles) {
    return wait_parity_bounded(&storage.empty[s.index], s.phase, max_cycles);
  }
  __device__ void producer_commit(const State& s) { ptx::mbarrier_arrive(&storage.full[s.index]); }

  __device__ void consumer_wait(const State& s) { wait_parity(&storage.full[s.index], s.phase); }
  __device__ bool consumer_wait_bounded(const State& s, uint64_t max_cycles) {
    return wait_parity_bounded(&storage.full[s.index], s.phase, max_cycles);
  }
  __device__ void consumer_release(const State& s) { ptx::mbarrier_arrive(&storage.empty[s.index]); }

  // Producer, before exit: every stage it committed has been released.
  __device__ void producer_tail(State s) {
#pragma unroll 1
    for (int i = 0; i < kStages; ++i) {
      producer_acquire(s);
      ++s;
    }
  }
};

}  // namespace jax_tma
