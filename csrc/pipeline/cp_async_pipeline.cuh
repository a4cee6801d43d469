// PipelineCpAsync: a ring of kStages buffers filled by non-bulk cp.async copies (16 bytes per
// thread per instruction) and drained by consumers.
//
// full[s]  completes when each of the `producer_threads` threads has committed (its
//          cp.async.mbarrier.arrive.noinc fires once all of that thread's earlier cp.async
//          have landed), so the counted arrivals are exactly the producer threads.
// empty[s] completes after `consumer_arrivals` consumer releases.
// Every producer thread calls producer_acquire before issuing its copies for a stage.
#pragma once

#include <cstdint>

#include "pipeline/barrier_ring.cuh"
#include "ptx/cp_async.cuh"

namespace jax_tma {

template <int kStages>
struct PipelineCpAsync : BarrierRing<kStages> {
  using Ring = BarrierRing<kStages>;
  using typename Ring::SharedStorage;
  using typename Ring::State;
  using Ring::Ring;

  __device__ static void init(SharedStorage& s, uint32_t producer_threads,
                              uint32_t consumer_arrivals) {
    Ring::init(s, producer_threads, consumer_arrivals);
  }

  // Every producer thread, after issuing its cp.async for the stage: the stage's full barrier
  // receives this thread's arrival once those copies have landed.
  __device__ void producer_commit(const State& s) {
    ptx::cp_async_mbarrier_arrive_noinc(&this->storage.full[s.index]);
  }
};

}  // namespace jax_tma
