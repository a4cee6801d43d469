// OrderedBarrier (PipelineOrder): kGroups groups of threads (e.g. consumer warpgroups) take
// turns through kDepth sequenced sections, in group order 0, 1, ..., kGroups - 1, 0, ... for each
// section. Group g may enter section d for its n-th time only after group g - 1 has left it for
// its n-th time (group 0: after group kGroups - 1 has left it for the (n-1)-th time).
//
// barrier[d][g] gates group g's entry to section d; leaving a section arrives on the next
// group's barrier. Group 0's first pass through every section waits on parity 1 of a fresh
// barrier, which is complete, so group 0 starts.
#pragma once

#include <cstdint>

#include "pipeline/barrier_wait.cuh"
#include "ptx/mbarrier.cuh"

namespace jax_tma {

template <int kGroups, int kDepth>
struct OrderedBarrier {
  static_assert(kGroups >= 2 && kDepth >= 1);

  struct SharedStorage {
    uint64_t barrier[kDepth][kGroups];
  };

  SharedStorage& storage;
  uint32_t group;
  uint32_t section = 0;
  uint32_t phase;

  // `arrivals`: how many threads of a group arrive when it leaves a section (1 if the group
  // elects one thread after its own sync, else the group's thread count).
  __device__ static void init(SharedStorage& s, uint32_t arrivals) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) ptx::mbarrier_init(&s.barrier[d][g], arrivals);
    }
  }

  __device__ OrderedBarrier(SharedStorage& s, uint32_t group_index)
      : storage(s), group(group_index), phase(group_index == 0 ? 1u : 0u) {}

  // Enter the current section (block until it is this group's turn).
  __device__ void wait() {
    wait_parity(&storage.barrier[section][group], phase, "ordered barrier (turn)",
                static_cast<int>(section));
  }
  __device__ bool wait_bounded(uint64_t max_cycles) {
    return wait_parity_bounded(&storage.barrier[section][group], phase, max_cycles);
  }

  // Leave the current section: hand it to the next group and move to the next section.
  __device__ void arrive() {
    ptx::mbarrier_arrive(&storage.barrier[section][(group + 1) % kGroups]);
    if (++section == kDepth) {
      section = 0;
      phase ^= 1u;
    }
  }
};

}  // namespace jax_tma
