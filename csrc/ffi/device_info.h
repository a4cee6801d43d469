// Per-device facts, read once per device ordinal and cached under a mutex: what the handlers
// need at every call (compute capability, SM count), and what the configuration heuristic's
// cost model needs at every trace (DRAM bandwidth, L2 size). Reading them never touches a
// stream, so the handlers stay command-buffer compatible.
#pragma once

#include <string>

namespace jax_tma::ffi_util {

struct DeviceInfo {
  int major = 0;
  int minor = 0;
  int num_sms = 0;
  // Peak DRAM bandwidth in bytes per second: two transfers per memory clock across the whole
  // bus (3.35e12 for an H100 SXM, 4.81e12 for an H200). 0 when the driver does not report the
  // clock or the bus width.
  double peak_dram_bytes_per_s = 0.0;
  // Bytes of L2 cache (50 MiB on an H100 SXM and an H200); 0 when the driver does not say.
  long long l2_cache_bytes = 0;
  std::string error;  // non-empty when the device could not be queried
};

const DeviceInfo& device_info(int ordinal);

// Makes `ordinal` the calling thread's current device for the runtime API; returns an error
// message or an empty string.
std::string use_device(int ordinal);

}  // namespace jax_tma::ffi_util
