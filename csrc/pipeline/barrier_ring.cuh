// BarrierRing: the full/empty mbarrier pair of each of kStages shared-memory stages, and the
// waits every pipeline shares. The pipelines (PipelineAsync, PipelineCpAsync, PipelineTmaAsync)
// build on it and add how their producers signal a full stage and their consumers an empty one.
//
// full[s]  completes when stage s holds data for the consumers;
// empty[s] completes when the consumers have released stage s to the producer.
// Only this file, the pipelines and pipeline_state.cuh touch phases and stage indices.
#pragma once

#include <cstdint>

#include "pipeline/barrier_wait.cuh"
#include "pipeline/pipeline_state.cuh"
#include "ptx/mbarrier.cuh"

namespace jax_tma {

template <int kStages>
struct BarrierRing {
  using State = PipelineState<kStages>;

  struct SharedStorage {
    uint64_t full[kStages];
    uint64_t empty[kStages];
  };

  SharedStorage& storage;

  __device__ explicit BarrierRing(SharedStorage& s) : storage(s) {}

  // One thread initialises; the caller makes the barriers visible (fence + CTA/cluster sync)
  // before any other thread, or any peer CTA, uses them.
  __device__ static void init(SharedStorage& s, uint32_t full_arrivals, uint32_t empty_arrivals) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      ptx::mbarrier_init(&s.full[i], full_arrivals);
      ptx::mbarrier_init(&s.empty[i], empty_arrivals);
    }
  }

  // Producer: block until the consumers have released the stage.
  __device__ void producer_acquire(const State& s) {
    wait_parity(&storage.empty[s.index], s.phase, "empty barrier (producer_acquire)",
                static_cast<int>(s.index));
  }
  __device__ bool producer_acquire_bounded(const State& s, uint64_t max_cycles) {
    return wait_parity_bounded(&storage.empty[s.index], s.phase, max_cycles);
  }

  // Producer, before exit: wait until every stage it filled has been released, so no copy or
  // consumer arrival targets shared memory of a CTA that has finished.
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

  // Consumer: block until the stage holds its data.
  __device__ void consumer_wait(const State& s) {
    wait_parity(&storage.full[s.index], s.phase, "full barrier (consumer_wait)",
                static_cast<int>(s.index));
  }
  // Consumer: one try_wait on whether the stage holds its data (acquiring it if so). Issued
  // early and its answer used late (consumer_wait only where it was false), its latency runs
  // alongside the work in between. NOTE: where the stage is not full yet, try_wait may suspend
  // the thread for a while before answering false (cuBLAS's promoting FP8 loop probes so, with
  // SYNCS.PHASECHK.TRANS64.TRYWAIT; mbarrier.test_wait would answer at once).
  __device__ bool consumer_probe(const State& s) {
    return ptx::mbarrier_try_wait_parity(&storage.full[s.index], s.phase);
  }
  __device__ bool consumer_wait_bounded(const State& s, uint64_t max_cycles) {
    return wait_parity_bounded(&storage.full[s.index], s.phase, max_cycles);
  }

  // Consumer (one thread per counted arrival): release the stage in this CTA.
  __device__ void consumer_release(const State& s) {
    ptx::mbarrier_arrive(&storage.empty[s.index]);
  }
};

}  // namespace jax_tma
