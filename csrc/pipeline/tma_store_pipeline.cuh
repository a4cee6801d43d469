// PipelineTmaStore: a ring of kStages shared-memory buffers drained to global memory by TMA
// stores (the epilogue's side of the pipeline). Bulk async-groups belong to the thread that
// commits them, so one thread (the "issuer") calls every member; the writers of a buffer sync
// with it through a named barrier (see NamedBarrier).
//
// Per step:  issuer: producer_acquire()      -- the buffer's previous store has read it
//            (barrier)  writers fill buffer[state.index], then ptx::fence_proxy_async_shared()
//            (barrier)  issuer: tma_store(...) for the buffer, producer_commit(), ++state
// At the end the issuer calls producer_tail() before the CTA exits or reuses the buffers.
#pragma once

#include <cstdint>

#include "pipeline/pipeline_state.cuh"
#include "ptx/tma.cuh"

namespace jax_tma {

template <int kStages>
struct PipelineTmaStore {
  using State = PipelineState<kStages>;

  // Issuer: the store group issued kStages steps ago (the last one that read the buffer about
  // to be rewritten) has finished reading shared memory.
  __device__ static void producer_acquire() { ptx::tma_store_wait_read<kStages - 1>(); }

  // Issuer: close the group of stores issued for the current buffer.
  __device__ static void producer_commit() { ptx::tma_store_commit_group(); }

  // Issuer: every store has finished reading shared memory, so the buffers may be reused or
  // the CTA may exit. NOTE: the global writes need no wait: they are performed by the time
  // the grid completes, and waiting for them added their latency to every kernel's tail.
  __device__ static void producer_tail() { ptx::tma_store_wait_read<0>(); }
};

}  // namespace jax_tma
