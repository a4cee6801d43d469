// XLA FFI handlers of the FP8 products on Hopper (platform CUDA); operands, attributes and
// checks are described in fp8.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_handlers {

// jax_tma_fp8_gemm_sm90: (a, b, sa, sb, row_scale, col_scale, bias) -> out.
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8GemmSm90);
// jax_tma_fp8_gemm_sm90_into: (a, b, sa, sb, row_scale, col_scale, bias, out_in) -> out
// aliased to out_in (tests poison out_in).
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8GemmSm90Into);

}  // namespace jax_tma::ffi_handlers
