// EpilogueHandoff: a one-slot handshake through which a consumer warpgroup passes a staged
// output block to the epilogue warps (kernels/sm90_gemm.cuh, epilogue/epilogue_warps.cuh) and
// gets the staging buffers back once their stores have read them. Two mbarriers of one arrival
// each: `full` (the writer's elected thread, after the writers' own sync) and `empty` (the
// reader's store issuer, after its stores have read the buffers). The slot's descriptor is
// written by the writer's elected thread before it arrives (the arrival releases it).
//
// Writer (per block):  acquire()  fill the buffers and the slot  (sync)  commit()
// Reader (per block):  wait()  read the slot, transform, store  (stores read)  release()
// The buffers start free: the writer's first acquire waits on parity 1 of a fresh barrier,
// which is complete (as producers start at phase 1 on an empty ring).
#pragma once

#include <cstdint>

#include "pipeline/barrier_wait.cuh"
#include "ptx/mbarrier.cuh"

namespace jax_tma {

template <class Slot>
struct EpilogueHandoff {
  struct SharedStorage {
    uint64_t full;
    uint64_t empty;
    Slot slot;
  };

  // The storage is passed to every call rather than held, so that a consumer warpgroup keeps
  // one register for the handoff across its mainloop.
  uint32_t phase = 0;

  // One thread, before the barriers are used (made visible with the kernel's other barriers).
  __device__ static void init(SharedStorage& s) {
    ptx::mbarrier_init(&s.full, 1);
    ptx::mbarrier_init(&s.empty, 1);
  }

  // Writer, every thread: the reader has released the buffers of the block before.
  __device__ void acquire(SharedStorage& s) const {
    wait_parity(&s.empty, phase ^ 1u, "epilogue handoff (empty)");
  }
  // Writer, one thread, after the writers' sync: the block and the slot are the reader's.
  __device__ static void commit(SharedStorage& s) { ptx::mbarrier_arrive(&s.full); }

  // Reader, every thread: the writer has committed the block.
  __device__ void wait(SharedStorage& s) const {
    wait_parity(&s.full, phase, "epilogue handoff (full)");
  }
  // Reader, one thread, once the block's stores have read the buffers.
  __device__ static void release(SharedStorage& s) { ptx::mbarrier_arrive(&s.empty); }

  // Writer and reader, every thread, once per block.
  __device__ void advance() { phase ^= 1u; }
};

}  // namespace jax_tma
