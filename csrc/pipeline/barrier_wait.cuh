// Waiting on an mbarrier phase: unbounded for kernels, bounded for tests and diagnostics so a
// wrong transaction count or a missed phase flip reports a timeout instead of hanging.
//
// Debug builds (JAX_TMA_DEBUG defined: `JAX_TMA_DEBUG=1 pip install ...`) bound every kernel
// wait too: past JAX_TMA_DEBUG_WAIT_CYCLES SM cycles (default 2^35, ~20 s at Hopper clocks)
// the thread prints which barrier it waited on, its stage and phase, and traps, so the launch
// fails with an error instead of hanging the GPU.
#pragma once

#include <cstdint>
#include <cstdio>

#include "ptx/mbarrier.cuh"

#ifndef JAX_TMA_DEBUG_WAIT_CYCLES
#define JAX_TMA_DEBUG_WAIT_CYCLES (1ll << 35)
#endif

namespace jax_tma {

// `what` and `stage` name the barrier in a debug build's timeout report.
__device__ __forceinline__ void wait_parity(uint64_t* bar, uint32_t phase,
                                            [[maybe_unused]] const char* what = "mbarrier",
                                            [[maybe_unused]] int stage = -1) {
#ifdef JAX_TMA_DEBUG
  const long long start = clock64();
  while (!ptx::mbarrier_try_wait_parity(bar, phase)) {
    if (clock64() - start > JAX_TMA_DEBUG_WAIT_CYCLES) {
      printf("jax_tma: %s wait timed out: stage %d, phase %u, block %d, thread %d\n", what,
             stage, phase, static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x));
      __trap();
    }
  }
#else
  while (!ptx::mbarrier_try_wait_parity(bar, phase)) {
  }
#endif
}

// Returns false if the phase has not completed within `max_cycles` SM clock cycles.
__device__ __forceinline__ bool wait_parity_bounded(uint64_t* bar, uint32_t phase,
                                                    uint64_t max_cycles) {
  const long long start = clock64();
  while (!ptx::mbarrier_try_wait_parity(bar, phase)) {
    if (static_cast<uint64_t>(clock64() - start) > max_cycles) return false;
  }
  return true;
}

// As wait_parity_bounded, with cluster-scope acquire: for barriers that peer CTAs complete
// (st.async into this CTA's shared memory, remote arrivals), so their data is visible here.
__device__ __forceinline__ bool wait_parity_cluster_bounded(uint64_t* bar, uint32_t phase,
                                                            uint64_t max_cycles) {
  const long long start = clock64();
  while (!ptx::mbarrier_try_wait_parity_cluster(bar, phase)) {
    if (static_cast<uint64_t>(clock64() - start) > max_cycles) return false;
  }
  return true;
}

}  // namespace jax_tma
