// FFI handlers of the copy benchmark; see tma_copy_ffi.h. The TMA copy views x as a row-major
// tensor of 32-bit words [rows, row bytes / 4] (rows: the product of the leading dimensions), so
// any dtype and rank >= 1 works as long as a row is a multiple of 16 bytes (a TMA stride limit;
// a single row only needs whole words).
#include "testing/tma_copy_ffi.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "ffi/cuda_check.h"
#include "ffi/device_info.h"
#include "ffi/tensor_map.h"
#include "testing/tma_copy.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tma::ffi_handlers {
namespace {

using testing::kTmaCopyBoxCols;
using testing::kTmaCopyBoxRows;
using testing::kTmaCopyElementBytes;

constexpr int kMaxSmemPerSm = 227 * 1024;

ffi::Error tma_copy(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                    ffi::Result<ffi::AnyBuffer> y, int64_t stages, int64_t ctas_per_sm) {
  const auto dims = x.dimensions();
  if (dims.size() == 0 || x.element_count() == 0 || y->size_bytes() != x.size_bytes()) {
    return ffi::Error::InvalidArgument("tma copy: x must be a non-empty tensor of rank >= 1 and "
                                       "y the same size");
  }
  const uint64_t cols = static_cast<uint64_t>(dims[dims.size() - 1]);
  const uint64_t row_bytes = x.size_bytes() / x.element_count() * cols;
  const uint64_t rows = x.element_count() / cols;
  const uint64_t row_alignment = rows > 1 ? 16 : kTmaCopyElementBytes;
  if (row_bytes % row_alignment != 0) {
    return ffi::Error::InvalidArgument("tma copy: rows of " + std::to_string(row_bytes) +
                                       " bytes are not a multiple of " +
                                       std::to_string(row_alignment));
  }
  if (stages != 4 && stages != 6 && stages != 12) {
    return ffi::Error::InvalidArgument("tma copy: stages must be 4, 6 or 12");
  }
  const auto& info = ffi_util::device_info(device);
  if (!info.error.empty()) return ffi::Error::Internal("tma copy: " + info.error);
  const uint32_t smem = testing::tma_copy_smem_bytes(static_cast<int>(stages));
  if (ctas_per_sm < 1 || ctas_per_sm * smem > kMaxSmemPerSm) {
    return ffi::Error::InvalidArgument("tma copy: " + std::to_string(ctas_per_sm) + " CTAs of " +
                                       std::to_string(smem) +
                                       " bytes of shared memory do not fit on an SM");
  }
  // NOTE: a single row needs no stride; give it one that passes the 16-byte check.
  const uint64_t pitch = rows > 1 ? row_bytes : (row_bytes + 15) / 16 * 16;
  const uint64_t row_words = row_bytes / kTmaCopyElementBytes;
  const auto spec = ffi_util::make_2d_spec(CU_TENSOR_MAP_DATA_TYPE_UINT32, rows, row_words,
                                           pitch / kTmaCopyElementBytes, kTmaCopyBoxRows,
                                           kTmaCopyBoxCols, ffi_util::Swizzle::kNone);
  CUtensorMap map_in, map_out;
  std::string err = ffi_util::encode_tensor_map(&map_in, x.untyped_data(), spec);
  if (err.empty()) err = ffi_util::encode_tensor_map(&map_out, y->untyped_data(), spec);
  if (err.empty()) err = ffi_util::use_device(device);
  if (!err.empty()) return ffi::Error::InvalidArgument("tma copy: " + err);
  testing::TmaCopyArgs args{};
  args.map_in = &map_in;
  args.map_out = &map_out;
  args.tiles_per_row = static_cast<int>((row_words + kTmaCopyBoxCols - 1) / kTmaCopyBoxCols);
  const uint64_t tiles = args.tiles_per_row * ((rows + kTmaCopyBoxRows - 1) / kTmaCopyBoxRows);
  if (tiles > (uint64_t{1} << 31) - 1) {
    return ffi::Error::InvalidArgument("tma copy: too many tiles");
  }
  args.num_tiles = static_cast<int>(tiles);
  args.stages = static_cast<int>(stages);
  args.ctas = static_cast<int>(std::min<uint64_t>(tiles, info.num_sms * ctas_per_sm));
  return ffi_util::cuda_error(testing::launch_tma_copy(args, stream), "tma copy launch");
}

ffi::Error d2d_copy(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  if (y->size_bytes() != x.size_bytes()) {
    return ffi::Error::InvalidArgument("d2d copy: y must have the size of x");
  }
  return ffi_util::cuda_error(cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), x.size_bytes(),
                                              cudaMemcpyDeviceToDevice, stream),
                              "cudaMemcpyAsync");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestTmaCopy, tma_copy,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Ctx<ffi::DeviceOrdinal>()                  // device of the call
                                  .Arg<ffi::AnyBuffer>()                      // x
                                  .Ret<ffi::AnyBuffer>()                      // y = x
                                  .Attr<int64_t>("stages")                    // 4, 6 or 12
                                  .Attr<int64_t>("ctas_per_sm"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestD2dCopy, d2d_copy,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Arg<ffi::AnyBuffer>()                      // x
                                  .Ret<ffi::AnyBuffer>(),                     // y = x
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_tma::ffi_handlers
