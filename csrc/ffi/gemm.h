// XLA FFI handlers of the GEMM op (platform CUDA).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_handlers {

// jax_tma_gemm_sm90: (a[M, K], b[K, Nb]) -> d[M, N], N <= Nb < N + 8.
XLA_FFI_DECLARE_HANDLER_SYMBOL(GemmSm90);
// jax_tma_gemm_sm90_into: (a, b, d_in[M, N]) -> d aliased to d_in (tests poison d_in).
XLA_FFI_DECLARE_HANDLER_SYMBOL(GemmSm90Into);

}  // namespace jax_tma::ffi_handlers
