// EpilogueHandoff: a one-slot handshake through which a consumer warpgroup (the writer) passes a
// staged output block to the epilogue warps (the reader: kernels/sm90_gemm.cuh,
// epilogue/epilogue_warps.cuh) and gets the staging buffers back once their stores have read
// them. Two named barriers, each spanning both groups: `full` (the writers arrive once the
// block and the slot are written, the readers wait) and `empty` (the readers arrive once done
// with the buffers, the writers wait). A named barrier has no phases to run ahead of: each
// group arrives on one barrier only after waiting on the other, so arrivals and waits
// alternate. NOTE: compute-sanitizer's racecheck does not follow the order this (or the mbarrier
// pair it replaced) gives to the slot's plain shared-memory accesses: it reports hazards
// between a writer's slot write and the readers' earlier reads (88 here, 110 with the
// mbarriers; docs/ragged-and-epilogues.md).
//
// Writer (per block):  acquire()  fill the buffers and the slot  commit()
// Reader:              release() once at the start (the buffers start free), then per block
//                      wait()  read the slot, transform, store  (stores read)  release()
// After the writer's last block (an end marker in the slot), the reader does not release.
#pragma once

#include <cstdint>

#include "pipeline/named_barrier.cuh"

namespace jax_tma {

template <class Slot>
struct EpilogueHandoff {
  struct SharedStorage {
    Slot slot;
  };

  NamedBarrier full;   // writers + readers
  NamedBarrier empty;  // writers + readers

  // Writer, every thread: the reader has released the buffers and the slot.
  __device__ void acquire() const { empty.sync(); }
  // Writer, every thread, after its writes: the block and the slot are the reader's.
  __device__ void commit() const { full.arrive(); }

  // Reader, every thread: the writer has committed a block.
  __device__ void wait() const { full.sync(); }
  // Reader, every thread, after its last access (and the stores' reads) of the buffers.
  __device__ void release() const { empty.arrive(); }
};

}  // namespace jax_tma
