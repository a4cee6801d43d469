// What both Python extensions (_jax_tma and _jax_tma_testing) share: an XLA FFI handler as a
// capsule for jax.ffi.register_ffi_target(name, capsule, platform="CUDA"), and the XLA FFI API
// version their handlers were compiled against (jax_tma._ext does not register them with a
// jaxlib whose API is older).
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace jax_tma::nb_module {

template <class Fn>
nanobind::capsule handler_capsule(Fn* fn) {
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

inline void add_ffi_api_version(nanobind::module_& m) {
  m.attr("ffi_api_major") = XLA_FFI_API_MAJOR;
  m.attr("ffi_api_minor") = XLA_FFI_API_MINOR;
}

}  // namespace jax_tma::nb_module
