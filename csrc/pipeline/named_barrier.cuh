// Named barriers (bar.sync / bar.arrive): synchronise a subset of the CTA's warps, e.g. the
// two warps of an epilogue or one consumer warpgroup, without stopping the producer. Ids 1..15
// (0 is __syncthreads); the kernels take their ids from NamedBarrierId so no two uses collide.
#pragma once

#include <cstdint>

#include "ptx/warpgroup.cuh"

namespace jax_tma {

enum class NamedBarrierId : uint32_t {
  kEpilogue0 = 1,  // consumer warpgroup 0's epilogue
  kEpilogue1 = 2,  // consumer warpgroup 1's epilogue
  kEpilogueWarps = 3,  // the epilogue warps (kernels/sm90_gemm_kernel.cuh)
  kHandoffFull0 = 4,   // consumer warpgroup 0 -> the epilogue warps (pipeline/epilogue_handoff)
  kHandoffFull1 = 5,
  kHandoffEmpty0 = 6,  // the epilogue warps -> consumer warpgroup 0
  kHandoffEmpty1 = 7,
  kFirstFree = 8,  // first id no kernel reserves
};

struct NamedBarrier {
  uint32_t id;
  uint32_t threads;  // a multiple of 32: whole warps take part

  // Every participating thread waits until `threads` threads have arrived or synced.
  __device__ void sync() const { ptx::named_barrier_sync(id, threads); }
  // sync() for a barrier that the participating warps reach from different places in the code.
  __device__ void sync_unaligned() const { ptx::named_barrier_sync_unaligned(id, threads); }
  // Count this thread's arrival and go on (a producer signalling waiting consumers).
  __device__ void arrive() const { ptx::named_barrier_arrive(id, threads); }
};

}  // namespace jax_tma
