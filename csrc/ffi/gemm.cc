// XLA FFI handler for D = A @ B on Hopper (sm_90a): argument checks, tensor-map encoding and
// the launch of the configuration named by the attributes.
//
// Operands: A [M, K] and B [K, Nb] row-major, both bf16 or both fp16, K % 8 == 0 and
// Nb % 8 == 0 (TMA needs 16-byte row strides). B may carry up to 7 zero columns of padding
// past N so that any N runs here; D [M, N] is bf16, fp16 or fp32. Attributes block_n and
// stages pick one of the tile configurations compiled in kernels/sm90_gemm.h.
#include "ffi/gemm.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "ffi/cuda_check.h"
#include "ffi/device_info.h"
#include "ffi/tensor_map.h"
#include "kernels/sm90_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tma::ffi_handlers {
namespace {

using sm90_gemm::DType;
using sm90_gemm::LaunchArgs;

std::string shape_str(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

bool to_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::F32: *out = DType::kF32; return true;
    default: return false;
  }
}

template <class Tile>
bool tile_matches(int64_t block_n, int64_t stages) {
  return block_n == Tile::kBlockN && stages == Tile::kStages;
}

template <class In, class Tile>
cudaError_t launch_out(DType out, const LaunchArgs& args) {
  switch (out) {
    case DType::kBF16: return sm90_gemm::launch<In, __nv_bfloat16, Tile>(args);
    case DType::kF16: return sm90_gemm::launch<In, __half, Tile>(args);
    case DType::kF32: return sm90_gemm::launch<In, float, Tile>(args);
  }
  return cudaErrorInvalidValue;
}

template <class Tile>
cudaError_t launch_in(DType in, DType out, const LaunchArgs& args) {
  return in == DType::kBF16 ? launch_out<__nv_bfloat16, Tile>(out, args)
                            : launch_out<__half, Tile>(out, args);
}

template <class Tile>
ffi::Error encode_operands(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                           CUtensorMapDataType tma_type, CUtensorMap* map_a,
                           CUtensorMap* map_b) {
  const auto da = a.dimensions();
  const auto db = b.dimensions();
  // A [M, K]: boxes of kBlockM rows x kBlockK columns. B [K, Nb]: boxes of kBlockK rows x 64.
  auto spec_a = ffi_util::make_2d_spec(tma_type, da[0], da[1], da[1], Tile::kBoxA[1],
                                       Tile::kBoxA[0], ffi_util::Swizzle::k128B);
  auto spec_b = ffi_util::make_2d_spec(tma_type, db[0], db[1], db[1], Tile::kBoxB[1],
                                       Tile::kBoxB[0], ffi_util::Swizzle::k128B);
  std::string err = ffi_util::encode_tensor_map(map_a, a.untyped_data(), spec_a);
  if (!err.empty()) return ffi::Error::InvalidArgument("jax_tma gemm, operand a: " + err);
  err = ffi_util::encode_tensor_map(map_b, b.untyped_data(), spec_b);
  if (!err.empty()) return ffi::Error::InvalidArgument("jax_tma gemm, operand b: " + err);
  return ffi::Error::Success();
}

template <class Tile>
ffi::Error run_tile(DType in, DType out, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                    LaunchArgs args) {
  CUtensorMap map_a;
  CUtensorMap map_b;
  const auto tma_type =
      in == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  if (auto err = encode_operands<Tile>(a, b, tma_type, &map_a, &map_b); err.failure()) {
    return err;
  }
  args.tmap_a = &map_a;
  args.tmap_b = &map_b;
  return ffi_util::cuda_error(launch_in<Tile>(in, out, args), "jax_tma gemm launch");
}

ffi::Error gemm_sm90(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                     ffi::AnyBuffer d, int64_t block_n, int64_t stages) {
  const auto da = a.dimensions();
  const auto db = b.dimensions();
  const auto dd = d.dimensions();
  if (da.size() != 2 || db.size() != 2 || dd.size() != 2) {
    return ffi::Error::InvalidArgument("jax_tma gemm expects 2-D operands, got a" +
                                       shape_str(da) + ", b" + shape_str(db) + ", d" +
                                       shape_str(dd));
  }
  const int64_t m = da[0], k = da[1], nb = db[1], n = dd[1];
  if (db[0] != k || dd[0] != m || n > nb || nb - n >= 8 || m < 1 || n < 1 || k < 1) {
    return ffi::Error::InvalidArgument("jax_tma gemm: inconsistent shapes a" + shape_str(da) +
                                       ", b" + shape_str(db) + ", d" + shape_str(dd));
  }
  if (k % 8 != 0 || nb % 8 != 0) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm: K and the padded N of b must be multiples of 8 (16-byte TMA strides), "
        "got a" + shape_str(da) + ", b" + shape_str(db));
  }
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
    return ffi::Error::InvalidArgument("jax_tma gemm: dimensions must fit in int32");
  }
  DType in, in_b, out;
  if (!to_dtype(a.element_type(), &in) || !to_dtype(b.element_type(), &in_b) || in != in_b ||
      in == DType::kF32 || !to_dtype(d.element_type(), &out)) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm: a and b must both be bf16 or both fp16 and d bf16, fp16 or fp32");
  }

  const auto& info = ffi_util::device_info(device);
  if (!info.error.empty()) return ffi::Error::Internal("jax_tma gemm: " + info.error);
  if (info.major != 9 || info.minor != 0) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm: the sm_90a kernel needs a compute capability 9.0 GPU, device " +
        std::to_string(device) + " is " + std::to_string(info.major) + "." +
        std::to_string(info.minor));
  }
  if (std::string err = ffi_util::use_device(device); !err.empty()) {
    return ffi::Error::Internal("jax_tma gemm: " + err);
  }

  LaunchArgs args{};
  args.d = d.untyped_data();
  args.shape = {static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), n};
  args.num_sms = info.num_sms;
  args.stream = stream;
  if (tile_matches<sm90_gemm::Tile128x128>(block_n, stages)) {
    return run_tile<sm90_gemm::Tile128x128>(in, out, a, b, args);
  }
  if (tile_matches<sm90_gemm::Tile128x256>(block_n, stages)) {
    return run_tile<sm90_gemm::Tile128x256>(in, out, a, b, args);
  }
  return ffi::Error::InvalidArgument("jax_tma gemm: no compiled configuration with block_n=" +
                                     std::to_string(block_n) +
                                     " and stages=" + std::to_string(stages));
}

ffi::Error gemm_sm90_out(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                         ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> d, int64_t block_n,
                         int64_t stages) {
  return gemm_sm90(stream, device, a, b, *d, block_n, stages);
}

ffi::Error gemm_sm90_into(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                          ffi::AnyBuffer b, ffi::AnyBuffer /*d_in, aliased to d*/,
                          ffi::Result<ffi::AnyBuffer> d, int64_t block_n, int64_t stages) {
  return gemm_sm90(stream, device, a, b, *d, block_n, stages);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmSm90, gemm_sm90_out,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Ctx<ffi::DeviceOrdinal>()                  // device of the call
                                  .Arg<ffi::AnyBuffer>()                      // a [M, K]
                                  .Arg<ffi::AnyBuffer>()                      // b [K, Nb]
                                  .Ret<ffi::AnyBuffer>()                      // d [M, N]
                                  .Attr<int64_t>("block_n")                   // tile N
                                  .Attr<int64_t>("stages"),                   // pipeline depth
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmSm90Into, gemm_sm90_into,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Ctx<ffi::DeviceOrdinal>()                  // device of the call
                                  .Arg<ffi::AnyBuffer>()                      // a [M, K]
                                  .Arg<ffi::AnyBuffer>()                      // b [K, Nb]
                                  .Arg<ffi::AnyBuffer>()                      // d_in [M, N]
                                  .Ret<ffi::AnyBuffer>()                      // d, aliases d_in
                                  .Attr<int64_t>("block_n")                   // tile N
                                  .Attr<int64_t>("stages"),                   // pipeline depth
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_tma::ffi_handlers
