// XLA FFI handlers of the copy benchmark (benchmarks/bench_tma_copy.py): the persistent TMA
// copy kernel and, as its baseline, cudaMemcpyAsync device to device on the same stream.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_handlers {

XLA_FFI_DECLARE_HANDLER_SYMBOL(TestTmaCopy);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestD2dCopy);

}  // namespace jax_tma::ffi_handlers
