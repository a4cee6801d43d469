// Warpgroup-level control: register reallocation (setmaxnreg) and named barriers (bar.sync).
#pragma once

#include <cstdint>

namespace jax_tma::ptx {

// setmaxnreg.inc: grow this warpgroup's per-thread register budget to kRegs.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// setmaxnreg.dec: shrink this warpgroup's per-thread register budget to kRegs.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// bar.sync on named barrier `id` (1..15; 0 is __syncthreads) among `threads` threads.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// barrier.sync without .aligned: for a barrier whose participants reach it at different
// instructions (bar.sync is barrier.sync.aligned, which requires one instruction for all of them;
// compute-sanitizer's synccheck stops a kernel that breaks that).
__device__ __forceinline__ void named_barrier_sync_unaligned(uint32_t id, uint32_t threads) {
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// bar.arrive on named barrier `id`: signal without waiting.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace jax_tma::ptx
