// Per-device facts the handlers need at every call (compute capability, SM count), read once
// per device ordinal and cached under a mutex. Reading them never touches a stream, so the
// handlers stay command-buffer compatible.
#pragma once

#include <string>

namespace jax_tma::ffi_util {

struct DeviceInfo {
  int major = 0;
  int minor = 0;
  int num_sms = 0;
  std::string error;  // non-empty when the device could not be queried
};

const DeviceInfo& device_info(int ordinal);

// Makes `ordinal` the calling thread's current device for the runtime API; returns an error
// message or an empty string.
std::string use_device(int ordinal);

}  // namespace jax_tma::ffi_util
