// The Python extension jax_tma._jax_tma: hands XLA FFI handlers to Python as capsules, to be
// registered with jax.ffi.register_ffi_target(name, capsule, platform="CUDA").
#include <nanobind/nanobind.h>

#include "ffi/dense.h"
#include "ffi/device_info.h"
#include "ffi/fp8.h"
#include "ffi/gemm.h"
#include "ffi/ragged_dot.h"
#include "ffi/testing.h"
#include "ffi/tma_copy.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

template <class Fn>
nb::capsule handler_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_tma, m) {
  m.doc() = "jax_tma CUDA kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_tma_gemm_sm90"] = handler_capsule(jax_tma::ffi_handlers::GemmSm90);
    targets["jax_tma_gemm_sm90_into"] = handler_capsule(jax_tma::ffi_handlers::GemmSm90Into);
    targets["jax_tma_dense_sm90"] = handler_capsule(jax_tma::ffi_handlers::DenseSm90);
    targets["jax_tma_dense_sm90_into"] = handler_capsule(jax_tma::ffi_handlers::DenseSm90Into);
    targets["jax_tma_fp8_gemm_sm90"] = handler_capsule(jax_tma::ffi_handlers::Fp8GemmSm90);
    targets["jax_tma_fp8_gemm_sm90_into"] =
        handler_capsule(jax_tma::ffi_handlers::Fp8GemmSm90Into);
    targets["jax_tma_ragged_dot_sm90"] = handler_capsule(jax_tma::ffi_handlers::RaggedDotSm90);
    targets["jax_tma_ragged_dot_sm90_into"] =
        handler_capsule(jax_tma::ffi_handlers::RaggedDotSm90Into);
    return targets;
  });
  // Targets of the primitive tests (jax_tma._testing).
  m.def("testing_registrations", []() {
    nb::dict targets;
    targets["jax_tma_test_tma_round_trip"] = handler_capsule(jax_tma::ffi_handlers::TestTmaRoundTrip);
    targets["jax_tma_test_tma_reduce_add"] = handler_capsule(jax_tma::ffi_handlers::TestTmaReduceAdd);
    targets["jax_tma_test_tma_multicast"] = handler_capsule(jax_tma::ffi_handlers::TestTmaMulticast);
    targets["jax_tma_test_pipeline_phases"] =
        handler_capsule(jax_tma::ffi_handlers::TestPipelinePhases);
    targets["jax_tma_test_pair_math"] = handler_capsule(jax_tma::ffi_handlers::TestPairMath);
    targets["jax_tma_test_tensormap_replace"] =
        handler_capsule(jax_tma::ffi_handlers::TestTensormapReplace);
    targets["jax_tma_test_cp_async_pipeline"] =
        handler_capsule(jax_tma::ffi_handlers::TestCpAsyncPipeline);
    targets["jax_tma_test_dsmem_ring"] = handler_capsule(jax_tma::ffi_handlers::TestDsmemRing);
    targets["jax_tma_test_tma_multicast_pipeline"] =
        handler_capsule(jax_tma::ffi_handlers::TestTmaMulticastPipeline);
    targets["jax_tma_test_tma_store_pipeline"] =
        handler_capsule(jax_tma::ffi_handlers::TestTmaStorePipeline);
    targets["jax_tma_test_named_barrier_ping_pong"] =
        handler_capsule(jax_tma::ffi_handlers::TestNamedBarrierPingPong);
    targets["jax_tma_test_ordered_barrier"] =
        handler_capsule(jax_tma::ffi_handlers::TestOrderedBarrier);
    targets["jax_tma_test_tma_copy"] = handler_capsule(jax_tma::ffi_handlers::TestTmaCopy);
    targets["jax_tma_test_d2d_copy"] = handler_capsule(jax_tma::ffi_handlers::TestD2dCopy);
    return targets;
  });
  // Device facts for the configuration heuristic (jax_tma.gemm), by CUDA ordinal: 0 where the
  // driver does not say (ffi_util::DeviceInfo).
  m.def(
      "peak_dram_bytes_per_s",
      [](int ordinal) { return jax_tma::ffi_util::device_info(ordinal).peak_dram_bytes_per_s; },
      nb::arg("ordinal"));
  m.def(
      "l2_cache_bytes",
      [](int ordinal) { return jax_tma::ffi_util::device_info(ordinal).l2_cache_bytes; },
      nb::arg("ordinal"));
  // The XLA FFI API version these handlers were compiled against: a jaxlib whose API is older
  // than this does not register them.
  m.attr("ffi_api_major") = XLA_FFI_API_MAJOR;
  m.attr("ffi_api_minor") = XLA_FFI_API_MINOR;
}
