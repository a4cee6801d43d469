// EpilogueLoad: one TMA load of an [M, N] operand (residual, saved pre-activation) into the
// epilogue's staging buffers, completing on one mbarrier that each use re-arms. The issuing
// thread arms it with the bytes of the boxes; every thread of the warpgroup then waits, and
// the phase flips. Only this file and the pipelines touch phases.
#pragma once

#include <cstdint>

#include "pipeline/barrier_wait.cuh"
#include "ptx/mbarrier.cuh"

namespace jax_tma {

struct EpilogueLoad {
  uint64_t* bar;
  uint32_t phase = 0;

  // One thread, before the barrier is used (made visible with the kernel's other barriers).
  __device__ static void init(uint64_t* bar) { ptx::mbarrier_init(bar, 1); }

  // Issuer: expect `bytes` of loads on the barrier; returns it for the copies.
  __device__ uint64_t* arm(uint32_t bytes) {
    ptx::mbarrier_arrive_expect_tx(bar, bytes);
    return bar;
  }

  // Every thread that reads the loaded data (all must call it, to keep the phase in step).
  __device__ void wait() {
    wait_parity(bar, phase, "epilogue load barrier", 0);
    phase ^= 1u;
  }
};

// EpilogueLoadRing: kSlots such barriers (consecutive), one per buffer of a ring that the
// issuer refills as the readers finish a slot; each slot's phase is one bit.
template <int kSlots>
struct EpilogueLoadRing {
  uint64_t* bars;
  uint32_t phases = 0;

  // Issuer: expect `bytes` of loads on slot `slot`'s barrier; returns it for the copies.
  __device__ uint64_t* arm(int slot, uint32_t bytes) {
    ptx::mbarrier_arrive_expect_tx(bars + slot, bytes);
    return bars + slot;
  }

  // Every reader thread, once per load of the slot.
  __device__ void wait(int slot) {
    wait_parity(bars + slot, (phases >> slot) & 1u, "epilogue load ring", slot);
    phases ^= 1u << slot;
  }
};

}  // namespace jax_tma
