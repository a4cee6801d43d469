// EpilogueHandoff: a one-slot handshake through which a consumer warpgroup (the writer) passes a
// staged output block to the epilogue warps (the reader: kernels/sm90_gemm_kernel.cuh,
// epilogue/epilogue_warps.cuh) and gets the staging buffers back once their stores have read
// them. Two named barriers, each spanning both groups, and both groups sync on both (no
// arrive-only side): every access of the buffers and the slot is separated from the other
// group's next conflicting access by a barrier both groups passed in between, which is the
// order compute-sanitizer's racecheck follows (it reported hazards on the slot while the groups
// only arrived on one of the two: docs/ragged-and-epilogues.md).
// The groups reach each barrier at different instructions, which an aligned bar.sync on both
// sides does not allow (synccheck stopped the kernel): the reader's syncs and the writer's
// `empty` are barrier.sync without .aligned; the writer's `full` stays bar.sync, as the
// unaligned form there cost the consumers ten registers (spills in the fused kernels).
//   empty  the buffers and the slot are the writer's: the reader syncs there once done with the
//          previous block (its stores have read the buffers), the writer before filling them;
//   full   the block and the slot are the reader's: the writer syncs there once they are
//          written, the reader before reading them.
// A named barrier has no phases to run ahead of: each group passes the two in turn, and a
// group reaches one only after passing the other, so the n-th passes of both groups meet.
// The reader syncs `empty` lazily, just before it waits for the next block (it is idle then),
// so the writer meets it there at once in steady state; the writer then waits on `full` only
// for the reader to come from `empty` (kernels pairing two writers with one reader sync both
// `empty`s before either `full`, so that neither writer waits for the other's block).
//
// Writer (per block):  acquire()  fill the buffers and the slot  commit()
// Reader (per block):  release()  wait()  read the slot, transform, store, (stores read)
// The writer's last block is an end marker in the slot (committed with commit_end()); the
// reader stops after reading it.
#pragma once

#include <cstdint>

#include "pipeline/named_barrier.cuh"

namespace jax_tma {

template <class Slot>
struct EpilogueHandoff {
  struct SharedStorage {
    Slot slot;
  };

  NamedBarrier full;   // writer + reader
  NamedBarrier empty;  // writer + reader

  // Writer, every thread: the reader is done with the buffers and the slot.
  __device__ void acquire() const { empty.sync_unaligned(); }
  // Writer, every thread, after its writes: the block and the slot are the reader's.
  __device__ void commit() const { full.sync(); }
  // Writer, every thread, after writing the end marker: commit(), unaligned.
  // NOTE: aligned there, compute-sanitizer's synccheck reported "Divergent thread(s) in block"
  // at this barrier whenever a CTA's last tile held rows for one consumer warpgroup only (the
  // other skipping that tile and closing from the mainloop's skip: M = 300 on 128 x 256 tiles,
  // in the activation-gradient and gated-gradient kernels; H100). Unaligned it reports none,
  // and ptxas allots the same registers (the consumers hold no accumulators here).
  __device__ void commit_end() const { full.sync_unaligned(); }

  // Reader, every thread, after its last access of the buffers (and the stores' reads of them),
  // and once at the start: the buffers and the slot are the writer's.
  __device__ void release() const { empty.sync_unaligned(); }
  // Reader, every thread: the writer has committed a block.
  __device__ void wait() const { full.sync_unaligned(); }
};

}  // namespace jax_tma
