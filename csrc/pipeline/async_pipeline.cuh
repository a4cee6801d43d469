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

#include "pipeline/barrier_ring.cuh"
#include "ptx/mbarrier.cuh"

namespace jax_tma {

template <int kStages>
struct PipelineAsync : BarrierRing<kStages> {
  using Ring = BarrierRing<kStages>;
  using typename Ring::SharedStorage;
  using typename Ring::State;
  using Ring::Ring;

  __device__ static void init(SharedStorage& s, uint32_t producer_arrivals,
                              uint32_t consumer_arrivals) {
    Ring::init(s, producer_arrivals, consumer_arrivals);
  }

  __device__ void producer_commit(const State& s) {
    ptx::mbarrier_arrive(&this->storage.full[s.index]);
  }
};

}  // namespace jax_tma
