// XLA FFI handler of the one-pass e4m3 block quantiser (contract/sm90_fp8_quantize.h):
//   x         [batch, rows, cols0]          fp32, bf16 or fp16, contiguous
//   x2        [batch, rows, cols - cols0]   x's type: two_parts = 1 (cols0 a multiple of 128),
//                                           else any placeholder
// -> values   [batch, rows, cols]           e4m3 (the parts side by side)
//    values_t [batch, cols, rows]           e4m3, with_transpose = 1 (any size, untouched, when 0)
//    scales   [batch, ceil(cols / 128), ceil(rows / 128)] fp32
// rows at most 65535 blocks of 128.
#include "ffi/fp8_quantize.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/checks.h"
#include "ffi/cuda_check.h"
#include "ffi/device_info.h"
#include "ffi/dispatch.h"
#include "contract/sm90_fp8_quantize.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tma::ffi_handlers {

struct Fp8QuantizeAttrs {
  int64_t with_transpose, two_parts;
};

namespace {

constexpr char kOp[] = "jax_tma fp8_quantize";  // every message's prefix

ffi::Error fp8_quantize_sm90(cudaStream_t stream, int32_t device,
                             ffi::AnyBuffer x,                      // fp32, bf16 or fp16
                             ffi::AnyBuffer x2,                     // x's type, or placeholder
                             ffi::Result<ffi::AnyBuffer> values,    // e4m3, x's shape
                             ffi::Result<ffi::AnyBuffer> values_t,  // e4m3, transposed
                             ffi::Result<ffi::AnyBuffer> scales,    // fp32
                             Fp8QuantizeAttrs attrs) {
  using fp8_quantize::Input;
  const auto dims = x.dimensions();
  if (dims.size() != 3) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": x must be [batch, rows, cols], got "
                                       "rank " + std::to_string(dims.size()));
  }
  const int64_t batch = dims[0], rows = dims[1], cols0 = dims[2];
  std::string shape = "x [" + std::to_string(batch) + ", " + std::to_string(rows) + ", " +
                      std::to_string(cols0) + "]";
  int64_t cols = cols0;
  if (attrs.two_parts != 0 && attrs.two_parts != 1) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": two_parts must be 0 or 1, got " +
                                       std::to_string(attrs.two_parts));
  }
  if (attrs.two_parts) {
    const auto dims2 = x2.dimensions();
    if (dims2.size() != 3 || dims2[0] != batch || dims2[1] != rows ||
        x2.element_type() != x.element_type() || cols0 % 128 != 0) {
      return ffi::Error::InvalidArgument(
          std::string(kOp) + ": with two parts, x2 must be [batch, rows, cols2] of x's type and "
          "x's columns a multiple of 128, got " + shape + " and x2 of rank " +
          std::to_string(dims2.size()));
    }
    cols += dims2[2];
    shape += ", x2 [.., " + std::to_string(dims2[2]) + "]";
  }
  Input input;
  switch (x.element_type()) {
    case ffi::DataType::F32: input = Input::kF32; break;
    case ffi::DataType::BF16: input = Input::kBF16; break;
    case ffi::DataType::F16: input = Input::kF16; break;
    default:
      return ffi::Error::InvalidArgument(std::string(kOp) + ": x must be fp32, bf16 or fp16 (" +
                                         shape + ")");
  }
  if (values->element_type() != ffi::DataType::F8E4M3FN ||
      (attrs.with_transpose && values_t->element_type() != ffi::DataType::F8E4M3FN) ||
      scales->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": values must be float8_e4m3fn and "
                                       "scales fp32 (" + shape + ")");
  }
  if (attrs.with_transpose != 0 && attrs.with_transpose != 1) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": with_transpose must be 0 or 1, got " +
                                       std::to_string(attrs.with_transpose));
  }
  const int64_t block = fp8_quantize::kBlock;
  const int64_t rb = (rows + block - 1) / block, cb = (cols + block - 1) / block;
  if (rb > 65535) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": rows must be at most 65535 * 128, "
                                       "got " + shape);
  }
  const int64_t elements = batch * rows * cols;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_element_counts(
      kOp,
      {{"values", elements, values->element_count()},
       {"values_t", attrs.with_transpose ? elements : int64_t(values_t->element_count()),
        values_t->element_count()},
       {"scales", batch * cb * rb, scales->element_count()}},
      shape));
  const ffi_util::DeviceInfo* info = nullptr;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_sm90_device(kOp, device, &info));
  fp8_quantize::QuantizeParams p{};
  p.x = x.untyped_data();
  p.x2 = attrs.two_parts ? x2.untyped_data() : nullptr;
  p.cols0 = cols0;
  p.values = static_cast<uint8_t*>(values->untyped_data());
  p.values_t = attrs.with_transpose ? static_cast<uint8_t*>(values_t->untyped_data()) : nullptr;
  p.scales = static_cast<float*>(scales->untyped_data());
  p.batch = batch, p.rows = rows, p.cols = cols;
  p.input = input;
  return ffi_util::cuda_error(fp8_quantize::launch_quantize_blocks(p, stream),
                              std::string(kOp) + ": launch");
}

}  // namespace
}  // namespace jax_tma::ffi_handlers

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_tma::ffi_handlers::Fp8QuantizeAttrs,
    xla::ffi::StructMember<int64_t>("with_transpose"),  // 1: write values_t
    xla::ffi::StructMember<int64_t>("two_parts"));      // 1: x2 follows x along cols

namespace jax_tma::ffi_handlers {

// Fp8QuantizeSm90Into takes values_in, values_t_in and scales_in after x2, aliased to the results.
JAX_TMA_DEFINE_HANDLER_PAIR(Fp8QuantizeSm90, Fp8QuantizeSm90Into, fp8_quantize_sm90, 3);

}  // namespace jax_tma::ffi_handlers
