// The Python extension jax_tma._jax_tma: hands the ops' XLA FFI handlers to Python as capsules,
// to be registered with jax.ffi.register_ffi_target(name, capsule, platform="CUDA"). The test
// targets (the ops' "_into" variants, the primitive test kernels) live in the separate extension
// jax_tma._jax_tma_testing (csrc/testing/module.cc), left out of a wheel built for users.
#include "ffi/dense.h"
#include "ffi/device_info.h"
#include "ffi/fp8.h"
#include "ffi/fp8_quantize.h"
#include "ffi/gemm.h"
#include "ffi/nb_module.h"
#include "ffi/ragged_dot.h"

namespace nb = nanobind;
using jax_tma::nb_module::handler_capsule;

NB_MODULE(_jax_tma, m) {
  m.doc() = "jax_tma CUDA kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_tma_gemm_sm90"] = handler_capsule(jax_tma::ffi_handlers::GemmSm90);
    targets["jax_tma_dense_sm90"] = handler_capsule(jax_tma::ffi_handlers::DenseSm90);
    targets["jax_tma_fp8_gemm_sm90"] = handler_capsule(jax_tma::ffi_handlers::Fp8GemmSm90);
    targets["jax_tma_ragged_dot_sm90"] = handler_capsule(jax_tma::ffi_handlers::RaggedDotSm90);
    targets["jax_tma_gated_ragged_dot_sm90"] =
        handler_capsule(jax_tma::ffi_handlers::GatedRaggedDotSm90);
    targets["jax_tma_gated_ragged_grad_sm90"] =
        handler_capsule(jax_tma::ffi_handlers::GatedRaggedGradSm90);
    targets["jax_tma_fp8_ragged_dot_sm90"] =
        handler_capsule(jax_tma::ffi_handlers::Fp8RaggedDotSm90);
    targets["jax_tma_fp8_quantize_sm90"] = handler_capsule(jax_tma::ffi_handlers::Fp8QuantizeSm90);
    return targets;
  });
  // Device facts for the configuration heuristic (jax_tma.ops.gemm.config), by CUDA ordinal:
  // 0 where the driver does not say (ffi_util::DeviceInfo).
  m.def(
      "peak_dram_bytes_per_s",
      [](int ordinal) { return jax_tma::ffi_util::device_info(ordinal).peak_dram_bytes_per_s; },
      nb::arg("ordinal"));
  m.def(
      "l2_cache_bytes",
      [](int ordinal) { return jax_tma::ffi_util::device_info(ordinal).l2_cache_bytes; },
      nb::arg("ordinal"));
  jax_tma::nb_module::add_ffi_api_version(m);
}
