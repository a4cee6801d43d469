// Standalone program behind scripts/sanitize.sh (not part of the extension): one seeded fault
// per compute-sanitizer tool, in a kernel of the jax_tma namespace, so that the script proves
// each tool, with the same `--kernel-name kns=jax_tma` filter it applies to the extension,
// instruments and reports such a kernel before it trusts a clean report on the real cases.
//
//   sanitizer_seed memcheck    reads 256 MiB past the end of a cudaMalloc'd buffer
//   sanitizer_seed initcheck   reads a cudaMalloc'd buffer that nothing wrote
//   sanitizer_seed racecheck   two warps write one shared word with no barrier between them
//   sanitizer_seed synccheck   __syncwarp called by lanes its mask leaves out
//   sanitizer_seed clean       the same kernel, no fault (every tool must report 0)
//
// Exits 0 whether or not a tool is attached; the tool's summary line is what the script reads.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

namespace jax_tma::sanitizer_seed {

enum Mode : int { kClean = 0, kMemcheck, kInitcheck, kRacecheck, kSynccheck };

__global__ void seeded_fault_kernel(const float* x, int n, float* out, int mode) {
  __shared__ float word;
  const int t = threadIdx.x;
  float v = 0.0f;
  // Far past the end: a read just past it can land in the next small allocation (the driver
  // packs them), which memcheck rightly accepts.
  if (mode == kMemcheck && t == 0) v = x[n + (1 << 26)];
  if (mode != kMemcheck && t == 0) v = x[0];  // x is written by the host unless kInitcheck
  if (mode == kRacecheck && t % 32 == 0) word = static_cast<float>(t);  // warps 0 and 1 race
  if (mode == kSynccheck && t < 32) __syncwarp(0x0000ffffu);  // lanes 16..31 are not members
  __syncthreads();
  if (t == 0) out[0] = v + (mode == kRacecheck ? word : 0.0f);
}

int run(Mode mode) {
  constexpr int n = 256;
  float* x = nullptr;
  float* out = nullptr;
  if (cudaMalloc(&x, n * sizeof(float)) != cudaSuccess ||
      cudaMalloc(&out, sizeof(float)) != cudaSuccess) {
    std::printf("cudaMalloc failed\n");
    return 1;
  }
  if (mode != kInitcheck) cudaMemset(x, 0, n * sizeof(float));
  seeded_fault_kernel<<<1, 64>>>(x, n, out, mode);
  const cudaError_t err = cudaDeviceSynchronize();
  std::printf("seeded kernel: %s\n", cudaGetErrorName(err));
  cudaFree(x);
  cudaFree(out);
  return 0;
}

}  // namespace jax_tma::sanitizer_seed

int main(int argc, char** argv) {
  using namespace jax_tma::sanitizer_seed;
  const char* names[] = {"clean", "memcheck", "initcheck", "racecheck", "synccheck"};
  for (int m = 0; m < 5; ++m) {
    if (argc > 1 && std::strcmp(argv[1], names[m]) == 0) return run(static_cast<Mode>(m));
  }
  std::printf("usage: %s clean|memcheck|initcheck|racecheck|synccheck\n", argv[0]);
  return 2;
}
