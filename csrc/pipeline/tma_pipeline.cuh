// PipelineTmaAsync: a ring of kStages buffers filled by TMA (optionally multicast across a
// cluster) and drained by consumer warps.
//
// full[s]  completes when this CTA's producer has armed it (one arrive with the bytes that land
//          in this CTA's stage, whoever issues the copies) and those bytes have landed.
// empty[s] completes when every consumer warp that reads the stage has released it, in every
//          CTA whose stage this CTA's producer writes (multicast-aware): init it with
//          consumer warps per CTA x CTAs in the multicast group, and release with
//          consumer_release_cluster naming the CTAs whose producers write into this stage.
#pragma once

#include <cstdint>

#include "pipeline/barrier_ring.cuh"
#include "ptx/mbarrier.cuh"

namespace jax_tma {

template <int kStages>
struct PipelineTmaAsync : BarrierRing<kStages> {
  using Ring = BarrierRing<kStages>;
  using typename Ring::SharedStorage;
  using typename Ring::State;
  using Ring::Ring;

  __device__ static void init(SharedStorage& s, uint32_t consumer_arrivals) {
    Ring::init(s, 1, consumer_arrivals);
  }

  // Producer: arm the full barrier with the bytes that will land in this CTA's stage;
  // returns it for the copies.
  __device__ uint64_t* producer_expect_tx(const State& s, uint32_t bytes) {
    ptx::mbarrier_arrive_expect_tx(&this->storage.full[s.index], bytes);
    return &this->storage.full[s.index];
  }

  // Consumer, called by all 32 lanes of a consumer warp after the warp's reads of the stage:
  // one arrival on the empty barrier of every CTA in `cta_mask` (bit r = cluster rank r), i.e.
  // every CTA whose producer writes into this CTA's stage. Lane r signals CTA r.
  __device__ void consumer_release_cluster(const State& s, uint32_t cta_mask) {
    const uint32_t lane = threadIdx.x % 32;
    __syncwarp();
    if (lane < 16 && (cta_mask >> lane & 1u)) {
      ptx::mbarrier_arrive_remote(&this->storage.empty[s.index], lane);
    }
  }
};

}  // namespace jax_tma
