// Cached per-device properties; see device_info.h.
#include "ffi/device_info.h"

#include <cuda_runtime.h>

#include <map>
#include <mutex>

namespace jax_tma::ffi_util {

const DeviceInfo& device_info(int ordinal) {
  static std::mutex mutex;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(ordinal);
  if (it != cache.end()) return it->second;
  DeviceInfo info;
  cudaError_t err = cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, ordinal);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, ordinal);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, ordinal);
  }
  if (err != cudaSuccess) {
    info.error = std::string("querying CUDA device ") + std::to_string(ordinal) + " failed: " +
                 cudaGetErrorString(err);
    return cache.emplace(ordinal, info).first->second;
  }
  // The cost model's facts are optional: where the driver does not report one it stays 0 and
  // the heuristic uses a default.
  int clock_khz = 0;
  int bus_bits = 0;
  int l2_bytes = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, ordinal) == cudaSuccess &&
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, ordinal) == cudaSuccess) {
    info.peak_dram_bytes_per_s = 2.0 * 1e3 * clock_khz * (bus_bits / 8.0);
  }
  if (cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, ordinal) == cudaSuccess) {
    info.l2_cache_bytes = l2_bytes;
  }
  cudaGetLastError();  // leave no sticky error behind for the next runtime call to report
  return cache.emplace(ordinal, info).first->second;
}

std::string use_device(int ordinal) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current == ordinal) return {};
  err = cudaSetDevice(ordinal);
  if (err != cudaSuccess) {
    return std::string("selecting CUDA device ") + std::to_string(ordinal) + " failed: " +
           cudaGetErrorString(err);
  }
  return {};
}

}  // namespace jax_tma::ffi_util
