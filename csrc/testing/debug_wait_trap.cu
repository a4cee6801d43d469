// Standalone program behind tests/kernels/test_debug_build.py (not part of the extension): one CTA
// arms a stage's full barrier for 1024 bytes that no copy delivers, the wrong transaction count
// that a debug build's bounded waits exist to catch. Built with -DJAX_TMA_DEBUG, the consumer's
// wait must report the full barrier, its stage and phase, and trap: the launch fails and the
// program exits 1. `debug_wait_trap ok` arms the barrier for 0 bytes: the wait completes and
// the program exits 0.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "pipeline/pipeline_state.cuh"
#include "pipeline/tma_pipeline.cuh"

namespace {

constexpr int kStages = 2;

__global__ void wrong_count_kernel(uint32_t bytes) {
  using Pipeline = jax_tma::PipelineTmaAsync<kStages>;
  __shared__ Pipeline::SharedStorage storage;
  if (threadIdx.x == 0) {
    Pipeline::init(storage, 1);
    jax_tma::ptx::fence_mbarrier_init();
  }
  __syncthreads();
  Pipeline pipeline{storage};
  if (threadIdx.x == 0) {  // producer: arms stage 0 for `bytes`, issues no copy
    auto write = jax_tma::make_producer_start_state<kStages>();
    pipeline.producer_acquire(write);
    pipeline.producer_expect_tx(write, bytes);
  } else if (threadIdx.x == 32) {  // consumer
    auto read = jax_tma::make_consumer_start_state<kStages>();
    pipeline.consumer_wait(read);
    pipeline.consumer_release(read);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool ok = argc > 1 && std::strcmp(argv[1], "ok") == 0;
  wrong_count_kernel<<<1, 64>>>(ok ? 0u : 1024u);
  const cudaError_t err = cudaDeviceSynchronize();
  std::printf("launch: %s\n", cudaGetErrorName(err));
  return err == cudaSuccess ? 0 : 1;
}
