// XLA FFI handlers of the GEMM op (platform CUDA): batched, strided D[b] = A[b] @ B[b]; the
// attributes and their checks are described in gemm.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_handlers {

// jax_tma_gemm_sm90: (a, b) -> d, each a strided view into its flat buffer.
XLA_FFI_DECLARE_HANDLER_SYMBOL(GemmSm90);
// jax_tma_gemm_sm90_into: (a, b, d_in) -> d aliased to d_in (tests poison d_in).
XLA_FFI_DECLARE_HANDLER_SYMBOL(GemmSm90Into);

}  // namespace jax_tma::ffi_handlers
