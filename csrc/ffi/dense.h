// XLA FFI handlers of the fused dense products (platform CUDA); operands, attributes and
// checks are described in dense.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_handlers {

// jax_tma_dense_sm90: (a, b, b2, bias, aux) -> (out, pre, workspace).
XLA_FFI_DECLARE_HANDLER_SYMBOL(DenseSm90);
// jax_tma_dense_sm90_into: (a, b, b2, bias, aux, out_in, pre_in) -> out aliased to out_in, pre
// aliased to pre_in (tests poison both), workspace.
XLA_FFI_DECLARE_HANDLER_SYMBOL(DenseSm90Into);

}  // namespace jax_tma::ffi_handlers
