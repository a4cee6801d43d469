// Stream-K partial tiles (scheduler/tile_scheduler.cuh): a CTA that computes part of a tile's K
// range, not its start, leaves its fp32 accumulators in its slot of a global workspace and sets
// the slot's flag; the CTA that computes the start of the tile waits for the flag and adds the
// slot into its own accumulators before the epilogue. One slot per CTA and consumer warpgroup
// (a CTA leaves at most one partial tile: the first piece of its range), laid out in the
// accumulators' register order with the thread index fastest, so each warp moves whole
// 512-byte runs of float4. The flags are zeroed before the launch (kernels/sm90_gemm_launch.cuh).
//
// Workspace: `flags` (one uint32 per slot, padded: sm90_gemm::stream_k_flag_bytes) then the
// slots.
#pragma once

#include <cstdint>

#include "pipeline/named_barrier.cuh"
#include "ptx/memory.cuh"

namespace jax_tma {

template <int kAccRegs, int kWarpgroups>
struct PartialTiles {
  static constexpr int kThreads = 128;  // one consumer warpgroup
  static constexpr int kVectors = kAccRegs / 4;
  static_assert(kAccRegs % 4 == 0);

  uint32_t* flags;
  float4* slots;

  // Called by all threads of consumer warpgroup `warpgroup` of CTA `cta`: write `acc` into its
  // slot, then publish it.
  __device__ void store(int cta, int warpgroup, const float (&acc)[kAccRegs],
                        const NamedBarrier& barrier) {
    const int slot = cta * kWarpgroups + warpgroup;
    float4* dst = thread_vectors(slot);
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      dst[i * kThreads] = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
    }
    barrier.sync();  // every thread's stores happen before the flag's release
    if (threadIdx.x % kThreads == 0) ptx::store_release_gpu(&flags[slot], 1u);
  }

  // Called by all threads of consumer warpgroup `warpgroup`: wait for the slot that the same
  // warpgroup of CTA `cta` leaves and add it into `acc`.
  __device__ void accumulate(int cta, int warpgroup, float (&acc)[kAccRegs],
                             const NamedBarrier& barrier) {
    const int slot = cta * kWarpgroups + warpgroup;
    if (threadIdx.x % kThreads == 0) {
      while (ptx::load_acquire_gpu(&flags[slot]) == 0) __nanosleep(64);
    }
    barrier.sync();
    const float4* src = thread_vectors(slot);
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      const float4 v = __ldcg(src + i * kThreads);  // L2: written by another SM
      acc[4 * i] += v.x;
      acc[4 * i + 1] += v.y;
      acc[4 * i + 2] += v.z;
      acc[4 * i + 3] += v.w;
    }
  }

 private:
  // This thread's first float4 of `slot`; its next ones follow kThreads apart.
  __device__ float4* thread_vectors(int slot) const {
    return slots + static_cast<int64_t>(slot) * kVectors * kThreads + threadIdx.x % kThreads;
  }
};

}  // namespace jax_tma
