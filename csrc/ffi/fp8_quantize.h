// XLA FFI handlers of the one-pass e4m3 block quantiser on Hopper (platform CUDA); operands,
// attributes and checks are described in fp8_quantize.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_handlers {

// jax_tma_fp8_quantize_sm90: (x, x2) -> (values, values_t, scales).
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8QuantizeSm90);
// jax_tma_fp8_quantize_sm90_into: (x, x2, values_in, values_t_in, scales_in) -> the results
// aliased to the inputs after x2 (tests poison them).
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8QuantizeSm90Into);

}  // namespace jax_tma::ffi_handlers
