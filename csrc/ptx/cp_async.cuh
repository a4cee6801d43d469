// Non-bulk asynchronous copies (cp.async, sm_80+): 16-byte global -> shared copies issued per
// thread, tracked by per-thread commit groups or signalled on an mbarrier.
#pragma once

#include <cstdint>

#include "ptx/common.cuh"

namespace jax_tma::ptx {

// cp.async.cg 16 bytes; `src_bytes` < 16 zero-fills the tail (0 copies nothing, fills zeros).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src,
                                            uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(smem_dst)),
               "l"(gmem_src), "r"(src_bytes)
               : "memory");
}

// cp.async.commit_group: close this thread's current group of cp.async.
__device__ __forceinline__ void cp_async_commit_group() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// cp.async.wait_group: at most kPending of this thread's groups may still be in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// cp.async.mbarrier.arrive.noinc: the barrier receives one arrival (counted in its expected
// arrivals) once all of this thread's prior cp.async have completed.
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar))
               : "memory");
}

}  // namespace jax_tma::ptx
