// Turning CUDA runtime and driver status codes into XLA FFI errors.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_util {

inline xla::ffi::Error cuda_error(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(what + ": " + cudaGetErrorName(err) + " (" +
                                   cudaGetErrorString(err) + ")");
}

}  // namespace jax_tma::ffi_util
