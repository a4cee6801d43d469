// Argument checks shared by the op handlers (ffi/gemm.cc, dense.cc, fp8.cc, ragged_dot.cc).
// Each returns an ffi::Error that is success when the check passes, else a message that opens
// with the op's prefix ("jax_tma gemm") and names the offending values; the string results of
// tensor_map.h and gemm_maps.h become errors here too.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "ffi/device_info.h"
#include "ffi/tensor_map.h"
#include "xla/ffi/api/ffi.h"

// Returns the error from the enclosing handler when `expr` (an ffi::Error) is one.
#define JAX_TMA_RETURN_IF_ERROR(expr)                                             \
  do {                                                                            \
    if (::xla::ffi::Error jax_tma_error_ = (expr); jax_tma_error_.failure()) {    \
      return jax_tma_error_;                                                      \
    }                                                                             \
  } while (0)

namespace jax_tma::ffi_util {

// InvalidArgument "<prefix>: <message>" when `message` (a check's result) is not empty.
inline xla::ffi::Error invalid_if(const std::string& prefix, const std::string& message) {
  if (message.empty()) return xla::ffi::Error::Success();
  return xla::ffi::Error::InvalidArgument(prefix + ": " + message);
}

// encode_tensor_map, its message prefixed by `prefix` (the op, and which map where it says).
inline xla::ffi::Error encode(const std::string& prefix, CUtensorMap* map, void* base,
                              const TensorMapSpec& spec) {
  return invalid_if(prefix, encode_tensor_map(map, base, spec));
}

// Every size in [1, 2^log2_limit): "<op>: <names> must be in [1, 2^N), got <dims>".
inline xla::ffi::Error check_sizes(const char* op, const char* names,
                                   std::initializer_list<int64_t> values, int log2_limit,
                                   const std::string& dims) {
  for (int64_t v : values) {
    if (v < 1 || v >= (int64_t{1} << log2_limit)) {
      return xla::ffi::Error::InvalidArgument(std::string(op) + ": " + names +
                                              " must be in [1, 2^" + std::to_string(log2_limit) +
                                              "), got " + dims);
    }
  }
  return xla::ffi::Error::Success();
}

struct NamedValue {
  const char* name;
  int64_t value;
};

// Every value >= 0: "<op>: <what> must be >= 0, got <name>=<value>" for the first that is not.
inline xla::ffi::Error check_non_negative(const char* op, const char* what,
                                          std::initializer_list<NamedValue> values) {
  for (const NamedValue& v : values) {
    if (v.value < 0) {
      return xla::ffi::Error::InvalidArgument(std::string(op) + ": " + what +
                                              " must be >= 0, got " + v.name + "=" +
                                              std::to_string(v.value));
    }
  }
  return xla::ffi::Error::Success();
}

// NOTE: the tile schedulers number their work units in int32 and step past the last one by the
// grid's cluster count, so a call may have at most INT32_MAX / 2. The message reads
// "<op>: <lead><units> work units<detail()> exceed the scheduler's int32 numbering"; detail()
// (the call's sizes) is built only then.
template <class Detail>
xla::ffi::Error check_work_units(const char* op, int64_t units, const char* lead,
                                 const Detail& detail) {
  if (units <= INT32_MAX / 2) return xla::ffi::Error::Success();
  return xla::ffi::Error::InvalidArgument(std::string(op) + ": " + lead + std::to_string(units) +
                                          " work units" + detail() +
                                          " exceed the scheduler's int32 numbering");
}

inline xla::ffi::Error check_work_units(const char* op, int64_t units, const char* lead = "") {
  return check_work_units(op, units, lead, [] { return std::string(); });
}

// Split-K: `splits` ranges of ceil(k_blocks / splits) blocks of `block_k` each (`*per_split`),
// none empty, written as fp32 partial products when there is more than one.
inline xla::ffi::Error check_splits(const char* op, int64_t splits, int64_t k_blocks,
                                    int block_k, bool fp32_out, const std::string& dims,
                                    int64_t* per_split) {
  *per_split = splits < 1 ? 0 : (k_blocks + splits - 1) / splits;
  if (splits < 1 || splits > k_blocks || (k_blocks + *per_split - 1) / *per_split != splits ||
      (splits > 1 && !fp32_out)) {
    return xla::ffi::Error::InvalidArgument(
        std::string(op) + ": splits must leave no K range of " + std::to_string(block_k) +
        " empty (1 <= splits <= ceil(k / " + std::to_string(block_k) +
        "), each range as long as the first but the last) and split-K writes fp32 partial "
        "products, got splits=" + std::to_string(splits) + " (" + dims + ")");
  }
  return xla::ffi::Error::Success();
}

// A buffer's element count against what the attributes imply.
struct ElementCount {
  const char* name;
  int64_t elements;  // what the attributes need
  size_t have;       // the buffer's element_count()
};

// Every buffer holds exactly what the attributes need: "<op>: <name> holds H elements, the
// attributes need N (<dims>)" for the first that does not.
inline xla::ffi::Error check_element_counts(const char* op,
                                            std::initializer_list<ElementCount> counts,
                                            const std::string& dims) {
  for (const ElementCount& c : counts) {
    if (static_cast<size_t>(c.elements) != c.have) {
      return xla::ffi::Error::InvalidArgument(
          std::string(op) + ": " + c.name + " holds " + std::to_string(c.have) +
          " elements, the attributes need " + std::to_string(c.elements) + " (" + dims + ")");
    }
  }
  return xla::ffi::Error::Success();
}

// The sm_90a kernels run on compute capability 9.0 only. On success `*info` is the device's
// facts and the device is the thread's current one (the launches use the runtime API).
inline xla::ffi::Error check_sm90_device(const char* op, int32_t device,
                                         const DeviceInfo** info) {
  const DeviceInfo& d = device_info(device);
  if (!d.error.empty()) return xla::ffi::Error::Internal(std::string(op) + ": " + d.error);
  if (d.major != 9 || d.minor != 0) {
    return xla::ffi::Error::InvalidArgument(
        std::string(op) + ": the sm_90a kernel needs a compute capability 9.0 GPU, device " +
        std::to_string(device) + " is " + std::to_string(d.major) + "." +
        std::to_string(d.minor));
  }
  if (std::string use = use_device(device); !use.empty()) {
    return xla::ffi::Error::Internal(std::string(op) + ": " + use);
  }
  *info = &d;
  return xla::ffi::Error::Success();
}

}  // namespace jax_tma::ffi_util
