// XLA FFI handlers of the primitive tests (jax_tma._testing through the _jax_tma_testing
// extension); not part of the public API.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_handlers {

XLA_FFI_DECLARE_HANDLER_SYMBOL(TestTmaRoundTrip);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestTmaReduceAdd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestTmaMulticast);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestPipelinePhases);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestPairMath);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestTensormapReplace);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestCpAsyncPipeline);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestDsmemRing);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestTmaMulticastPipeline);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestTmaStorePipeline);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestNamedBarrierPingPong);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TestOrderedBarrier);

}  // namespace jax_tma::ffi_handlers
