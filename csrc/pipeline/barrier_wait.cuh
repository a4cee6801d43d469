// Waiting on an mbarrier phase: unbounded for kernels, bounded for tests and diagnostics so a
// wrong transaction count or a missed phase flip reports a timeout instead of hanging.
#pragma once

#include <cstdint>

#include "ptx/mbarrier.cuh"

namespace jax_tma {

__device__ __forceinline__ void wait_parity(uint64_t* bar, uint32_t phase) {
  while (!ptx::mbarrier_try_wait_parity(bar, phase)) {
  }
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
