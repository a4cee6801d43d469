// EpilogueHandoff: a handshake through which a consumer warpgroup (the writer) passes a staged
// output block and a descriptor slot to the epilogue warps (the reader: kernels/sm90_gemm.cuh,
// epilogue/epilogue_warps.cuh) and gets the staging buffers back once their stores have read
// them. Two named barriers, each spanning both groups:
//   full   both groups sync: the block and the slot are written (the reader waits there already
//          in steady state: it finished the block before long ago);
//   empty  the reader arrives once done with the buffers, the writer syncs before rewriting
//          them (the reader must not wait there: it serves the other warpgroup meanwhile).
// The slots alternate by block, so a slot is rewritten only after a `full` both groups passed
// since it was read (compute-sanitizer's racecheck orders accesses by such barriers; it did not
// follow an mbarrier pair, nor an arrive-only order). A named barrier has no phases to run
// ahead of: each group arrives on one barrier only after waiting on the other.
//
// Writer (per block):  acquire()  fill the buffers and slot()  commit()
// Reader:              release() once at the start (the buffers start free), then per block
//                      wait()  read slot(), transform, store  (stores read)  release()
// After the writer's last block (an end marker in the slot), the reader does not release.
#pragma once

#include <cstdint>

#include "pipeline/named_barrier.cuh"

namespace jax_tma {

template <class Slot>
struct EpilogueHandoff {
  struct SharedStorage {
    Slot slot[2];
  };

  NamedBarrier full;   // writers + readers
  NamedBarrier empty;  // writers + readers
  uint32_t block = 0;  // blocks handed over so far (the slot's index is its parity)

  __device__ Slot& slot(SharedStorage& s) const { return s.slot[block & 1u]; }

  // Writer, every thread: the reader has released the buffers.
  __device__ void acquire() const { empty.sync(); }
  // Writer, every thread, after its writes: the block and the slot are the reader's.
  __device__ void commit() {
    full.sync();
    ++block;
  }

  // Reader, every thread: the writer has committed a block (read slot(), then advance()).
  __device__ void wait() const { full.sync(); }
  __device__ void advance() { ++block; }
  // Reader, every thread, after its last access (and the stores' reads) of the buffers.
  __device__ void release() const { empty.arrive(); }
};

}  // namespace jax_tma
