// PipelineCpAsync: a ring of kStages buffers filled by non-bulk cp.async copies (16 bytes per
// thread per instruction) and drained by consumers.
//
// full[s]  completes when each of the `producer_threads` threads has committed (its
//          cp.async.mbarrier.arrive.noinc fires once all of that thread's earlier cp.async
//          have landed), so the counted arrivals are exactly the producer threads.
// empty[s] completes after `consumer_arrivals` consumer releases.
#pragma once

#include <cstdint>

#include "pipeline/barrier_wait.cuh"
#include "pipeline/pipeline_state.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/mbarrier.cuh"

namespace jax_tma {

template <int kStages>
struct PipelineCpAsync {
  using State = PipelineState<kStages>;

  struct SharedStorage {
    uint64_t full[kStages];
    uint64_t empty[kStages];
  };

  SharedStorage& storage;

  __device__ static void init(SharedStorage& s, uint32_t producer_threads,
                              uint32_t consumer_arrivals) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      ptx::mbarrier_init(&s.full[i], producer_threads);
      ptx::mbarrier_init(&s.empty[i], consumer_arrivals);
    }
  }

  // Every producer thread: block until the consumers have released the stage.
  __device__ void producer_acquire(const State& s) { wait_parity(&storage.empty[s.index], s.phase); }
  __device__ bool producer_acquire_bounded(const State& s, uint64_t max_cycles) {
    return wait_parity_bounded(&storage.empty[s.index], s.phase, max_cycles);
  }

  // Every producer thread, after issuing its cp.async for the stage: the stage's full barrier
  // receives this thread's arrival once those copies have landed.
  __device__ void producer_commit(const State& s) {
    ptx::cp_async_mbarrier_arrive_noinc(&storage.full[s.index]);
  }

  // Producer, before exit: every stage it committed has been released.
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

  __device__ void consumer_wait(const State& s) { wait_parity(&storage.full[s.index], s.phase); }
  __device__ bool consumer_wait_bounded(const State& s, uint64_t max_cycles) {
    return wait_parity_bounded(&storage.full[s.index], s.phase, max_cycles);
  }
  __device__ void consumer_release(const State& s) { ptx::mbarrier_arrive(&storage.empty[s.index]); }
};

}  // namespace jax_tma
