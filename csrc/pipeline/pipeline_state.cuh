// PipelineState: where a producer or consumer stands in a ring of kStages shared-memory stages.
//
// `index` is the stage, `phase` the parity of the ring pass, `count` the number of steps taken.
// The phase flips whenever the index wraps. Invariant between the two sides of one ring:
// a producer waits on empty[index] with its phase, a consumer on full[index] with its phase,
// and the producer starts at phase 1 because every buffer starts empty (waiting on parity 1 of
// a fresh barrier returns at once).
#pragma once

#include <cstdint>

namespace jax_tma {

template <int kStages>
struct PipelineState {
  static_assert(kStages >= 1, "a pipeline needs at least one stage");
  uint32_t index = 0;
  uint32_t phase = 0;
  uint32_t count = 0;

  __device__ __forceinline__ void advance() {
    ++count;
    if (++index == kStages) {
      index = 0;
      phase ^= 1;
    }
  }
  // `steps` steps at once: a consumer passing over stages that another consumer reads.
  __device__ __forceinline__ void advance(uint32_t steps) {
    count += steps;
    index += steps;
    phase ^= (index / kStages) & 1u;
    index %= kStages;
  }
  __device__ __forceinline__ PipelineState& operator++() {
    advance();
    return *this;
  }
};

template <int kStages>
__device__ __forceinline__ PipelineState<kStages> make_producer_start_state() {
  PipelineState<kStages> state;
  state.phase = 1;
  return state;
}

template <int kStages>
__device__ __forceinline__ PipelineState<kStages> make_consumer_start_state() {
  return PipelineState<kStages>{};
}

}  // namespace jax_tma
