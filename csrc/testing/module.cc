// The Python extension jax_tma._jax_tma_testing: the FFI targets only tests and benchmarks call,
// as capsules for jax.ffi.register_ffi_target(name, capsule, platform="CUDA") (through
// jax_tma._ext.register_testing). It holds the ops' "_into" variants, which write over a
// caller's buffer (NaN-poisoned output tests), the primitive test kernels of csrc/testing/ and
// the copy benchmark. A wheel for users is built without it (JAX_TMA_BUILD_TESTING=OFF).
#include "ffi/dense.h"
#include "ffi/fp8.h"
#include "ffi/fp8_quantize.h"
#include "ffi/gemm.h"
#include "ffi/nb_module.h"
#include "ffi/ragged_dot.h"
#include "testing/primitives_ffi.h"
#include "testing/tma_copy_ffi.h"

namespace nb = nanobind;
using jax_tma::nb_module::handler_capsule;

NB_MODULE(_jax_tma_testing, m) {
  m.doc() = "jax_tma test-only XLA FFI handlers";
  m.def("registrations", []() {
    namespace h = jax_tma::ffi_handlers;
    nb::dict targets;
    // The ops over a given output buffer (jax_tma._testing.gemm_poisoned, poison=True).
    targets["jax_tma_gemm_sm90_into"] = handler_capsule(h::GemmSm90Into);
    targets["jax_tma_dense_sm90_into"] = handler_capsule(h::DenseSm90Into);
    targets["jax_tma_fp8_gemm_sm90_into"] = handler_capsule(h::Fp8GemmSm90Into);
    targets["jax_tma_ragged_dot_sm90_into"] = handler_capsule(h::RaggedDotSm90Into);
    targets["jax_tma_gated_ragged_dot_sm90_into"] = handler_capsule(h::GatedRaggedDotSm90Into);
    targets["jax_tma_gated_ragged_grad_sm90_into"] = handler_capsule(h::GatedRaggedGradSm90Into);
    targets["jax_tma_fp8_ragged_dot_sm90_into"] = handler_capsule(h::Fp8RaggedDotSm90Into);
    targets["jax_tma_fp8_quantize_sm90_into"] = handler_capsule(h::Fp8QuantizeSm90Into);
    // The primitive test kernels.
    targets["jax_tma_test_tma_round_trip"] = handler_capsule(h::TestTmaRoundTrip);
    targets["jax_tma_test_tma_reduce_add"] = handler_capsule(h::TestTmaReduceAdd);
    targets["jax_tma_test_tma_multicast"] = handler_capsule(h::TestTmaMulticast);
    targets["jax_tma_test_pipeline_phases"] = handler_capsule(h::TestPipelinePhases);
    targets["jax_tma_test_pair_math"] = handler_capsule(h::TestPairMath);
    targets["jax_tma_test_tensormap_replace"] = handler_capsule(h::TestTensormapReplace);
    targets["jax_tma_test_cp_async_pipeline"] = handler_capsule(h::TestCpAsyncPipeline);
    targets["jax_tma_test_dsmem_ring"] = handler_capsule(h::TestDsmemRing);
    targets["jax_tma_test_tma_multicast_pipeline"] = handler_capsule(h::TestTmaMulticastPipeline);
    targets["jax_tma_test_tma_store_pipeline"] = handler_capsule(h::TestTmaStorePipeline);
    targets["jax_tma_test_named_barrier_ping_pong"] = handler_capsule(h::TestNamedBarrierPingPong);
    targets["jax_tma_test_ordered_barrier"] = handler_capsule(h::TestOrderedBarrier);
    // The copy benchmark (benchmarks/bench_tma_copy.py) and its cudaMemcpyAsync baseline.
    targets["jax_tma_test_tma_copy"] = handler_capsule(h::TestTmaCopy);
    targets["jax_tma_test_d2d_copy"] = handler_capsule(h::TestD2dCopy);
    return targets;
  });
  // Checked against the running jaxlib like the production extension's.
  jax_tma::nb_module::add_ffi_api_version(m);
}
