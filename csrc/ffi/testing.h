// XLA FFI handlers of the primitive tests (jax_tma._testing); not part of the public API.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_handlers {

XLA_FFI_DECLARE_HANDLER_SYMBOL(TestTmaRoundTrip);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestTmaReduceAdd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestTmaMulticast);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestPipelinePhases);

}  // namespace jax_tma::ffi_handlers
