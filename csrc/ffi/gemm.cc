// XLA FFI handler for D = A @ B on Hopper (sm_90a): argument checks, tensor-map encoding and
// the launch of the configuration named by the attributes.
//
// Operands: A [M, K] and B [K, Nb] row-major, both bf16 or both fp16, K % 8 == 0 and
// Nb % 8 == 0 (TMA needs 16-byte row strides). B may carry up to 7 zero columns of padding
// past N so that any N runs here; D [M, N] is the input type or fp32. With splits > 1, D is
// [splits, M, N] fp32: one partial product per K range, for the caller to sum. The attributes
// block_m, block_n, stages, cluster_m and epilogue name one of the tile configurations
// compiled in kernels/sm90_gemm.h.
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

// Attributes naming one compiled configuration (kernels/sm90_gemm.h).
struct TileChoice {
  int64_t block_m, block_n, stages, cluster_m, epilogue;
};

template <class Tile>
bool tile_matches(const TileChoice& c) {
  return c.block_m == Tile::kBlockM && c.block_n == Tile::kBlockN && c.stages == Tile::kStages &&
         c.cluster_m == Tile::kClusterM && c.epilogue == static_cast<int64_t>(Tile::kEpilogue);
}

template <class In, class Tile>
cudaError_t launch_out(DType out, const LaunchArgs& args) {
  if (out == DType::kF32) return sm90_gemm::launch<In, float, Tile>(args);
  return sm90_gemm::launch<In, In, Tile>(args);
}

template <class Tile>
cudaError_t launch_in(DType in, DType out, const LaunchArgs& args) {
  return in == DType::kBF16 ? launch_out<__nv_bfloat16, Tile>(out, args)
                            : launch_out<__half, Tile>(out, args);
}

CUtensorMapDataType tma_type(DType t) {
  switch (t) {
    case DType::kBF16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case DType::kF16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case DType::kF32: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  }
  return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
}

// D [splits, M, N] (row pitch ldd), stored in boxes of one epilogue chunk: 64 rows x 128 bytes.
ffi_util::TensorMapSpec output_spec(DType out, const sm90_gemm::GemmShape& shape) {
  const uint64_t bytes = sm90_gemm::dtype_bytes(out);
  ffi_util::TensorMapSpec spec;
  spec.dtype = tma_type(out);
  spec.rank = 3;
  spec.dims = {static_cast<uint64_t>(shape.n), static_cast<uint64_t>(shape.m),
               static_cast<uint64_t>(shape.splits), 0, 0};
  spec.byte_strides = {shape.ldd * bytes, shape.ldd * bytes * shape.m, 0, 0, 0};
  spec.box = {static_cast<uint32_t>(128 / bytes), 64, 1, 0, 0};
  spec.swizzle = ffi_util::Swizzle::k128B;
  return spec;
}

template <class Tile>
ffi::Error run_tile(DType in, DType out, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                    void* d, LaunchArgs args) {
  const auto da = a.dimensions();
  const auto db = b.dimensions();
  // A [M, K]: boxes of kBlockM rows x kBlockK columns. B [K, Nb]: boxes of kBlockK rows x 64.
  const auto spec_a = ffi_util::make_2d_spec(tma_type(in), da[0], da[1], da[1], Tile::kBoxA[1],
                                             Tile::kBoxA[0], ffi_util::Swizzle::k128B);
  const auto spec_b = ffi_util::make_2d_spec(tma_type(in), db[0], db[1], db[1], Tile::kBoxB[1],
                                             Tile::kBoxB[0], ffi_util::Swizzle::k128B);
  CUtensorMap map_a, map_b, map_d = {};
  std::string err = ffi_util::encode_tensor_map(&map_a, a.untyped_data(), spec_a);
  if (!err.empty()) return ffi::Error::InvalidArgument("jax_tma gemm, operand a: " + err);
  err = ffi_util::encode_tensor_map(&map_b, b.untyped_data(), spec_b);
  if (!err.empty()) return ffi::Error::InvalidArgument("jax_tma gemm, operand b: " + err);
  if (Tile::kEpilogue == sm90_gemm::EpilogueKind::kTmaStore) {
    err = ffi_util::encode_tensor_map(&map_d, d, output_spec(out, args.shape));
    if (!err.empty()) return ffi::Error::InvalidArgument("jax_tma gemm, output: " + err);
  }
  args.tmap_a = &map_a;
  args.tmap_b = &map_b;
  args.tmap_d = &map_d;
  args.d = d;
  return ffi_util::cuda_error(launch_in<Tile>(in, out, args), "jax_tma gemm launch");
}

// run_tile for the compiled configuration that `choice` names.
ffi::Error dispatch(const TileChoice& choice, DType in, DType out, const ffi::AnyBuffer& a,
                    const ffi::AnyBuffer& b, void* d, const LaunchArgs& args) {
#define JAX_TMA_TRY_TILE(TILE)                             \
  if (tile_matches<sm90_gemm::TILE>(choice)) {             \
    return run_tile<sm90_gemm::TILE>(in, out, a, b, d, args); \
  }
  JAX_TMA_SM90_GEMM_TILES(JAX_TMA_TRY_TILE)
#undef JAX_TMA_TRY_TILE
  return ffi::Error::InvalidArgument(
      "jax_tma gemm: no compiled configuration with block_m=" + std::to_string(choice.block_m) +
      ", block_n=" + std::to_string(choice.block_n) + ", stages=" +
      std::to_string(choice.stages) + ", cluster_m=" + std::to_string(choice.cluster_m) +
      ", epilogue=" + std::to_string(choice.epilogue));
}

ffi::Error gemm_sm90(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                     ffi::AnyBuffer d, const TileChoice& choice, int64_t splits) {
  const auto da = a.dimensions();
  const auto db = b.dimensions();
  const auto dd = d.dimensions();
  const std::string shapes = "a" + shape_str(da) + ", b" + shape_str(db) + ", d" + shape_str(dd);
  if (da.size() != 2 || db.size() != 2 || dd.size() != (splits > 1 ? 3u : 2u)) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm expects 2-D a and b and a d of [M, N] (or [splits, M, N] for split-K), "
        "got " + shapes);
  }
  const int64_t m = da[0], k = da[1], nb = db[1];
  const int64_t n = dd[dd.size() - 1];
  if (db[0] != k || dd[dd.size() - 2] != m || (splits > 1 && dd[0] != splits) || n > nb ||
      nb - n >= 8 || m < 1 || n < 1 || k < 1) {
    return ffi::Error::InvalidArgument("jax_tma gemm: inconsistent shapes " + shapes);
  }
  if (k % 8 != 0 || nb % 8 != 0) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm: K and the padded N of b must be multiples of 8 (16-byte TMA strides), "
        "got " + shapes);
  }
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
    return ffi::Error::InvalidArgument("jax_tma gemm: dimensions must fit in int32");
  }
  DType in, in_b, out;
  if (!to_dtype(a.element_type(), &in) || !to_dtype(b.element_type(), &in_b) || in != in_b ||
      in == DType::kF32 || !to_dtype(d.element_type(), &out) || (out != in && out != DType::kF32)) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm: a and b must both be bf16 or both fp16, and d their type or fp32");
  }
  const int64_t k_blocks = (k + 63) / 64;
  if (splits < 1 || splits > k_blocks || (splits > 1 && out != DType::kF32)) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm: splits must be in [1, K/64] and split-K writes fp32 partial products, "
        "got splits=" + std::to_string(splits) + " for " + shapes);
  }
  const int64_t per_split = (k_blocks + splits - 1) / splits;
  if ((k_blocks + per_split - 1) / per_split != splits) {
    return ffi::Error::InvalidArgument("jax_tma gemm: splits=" + std::to_string(splits) +
                                       " leaves an empty K range for K=" + std::to_string(k));
  }
  if (choice.epilogue == static_cast<int64_t>(sm90_gemm::EpilogueKind::kTmaStore) &&
      (n * sm90_gemm::dtype_bytes(out)) % 16 != 0) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm: the TMA-store epilogue needs 16-byte output rows (N a multiple of " +
        std::to_string(16 / sm90_gemm::dtype_bytes(out)) + "), got " + shapes);
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
  args.shape = {static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                static_cast<int>(splits), static_cast<int>(per_split), n};
  args.num_sms = info.num_sms;
  args.stream = stream;
  return dispatch(choice, in, out, a, b, d.untyped_data(), args);
}

ffi::Error gemm_sm90_out(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                         ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> d, int64_t block_m,
                         int64_t block_n, int64_t stages, int64_t cluster_m, int64_t epilogue,
                         int64_t splits) {
  return gemm_sm90(stream, device, a, b, *d, {block_m, block_n, stages, cluster_m, epilogue},
                   splits);
}

ffi::Error gemm_sm90_into(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                          ffi::AnyBuffer b, ffi::AnyBuffer /*d_in, aliased to d*/,
                          ffi::Result<ffi::AnyBuffer> d, int64_t block_m, int64_t block_n,
                          int64_t stages, int64_t cluster_m, int64_t epilogue, int64_t splits) {
  return gemm_sm90(stream, device, a, b, *d, {block_m, block_n, stages, cluster_m, epilogue},
                   splits);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmSm90, gemm_sm90_out,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Ctx<ffi::DeviceOrdinal>()                  // device of the call
                                  .Arg<ffi::AnyBuffer>()                      // a [M, K]
                                  .Arg<ffi::AnyBuffer>()                      // b [K, Nb]
                                  .Ret<ffi::AnyBuffer>()                      // d [(splits,) M, N]
                                  .Attr<int64_t>("block_m")                   // tile M
                                  .Attr<int64_t>("block_n")                   // tile N
                                  .Attr<int64_t>("stages")                    // pipeline depth
                                  .Attr<int64_t>("cluster_m")                 // CTAs per cluster
                                  .Attr<int64_t>("epilogue")                  // EpilogueKind
                                  .Attr<int64_t>("splits"),                   // split-K ranges
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmSm90Into, gemm_sm90_into,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Ctx<ffi::DeviceOrdinal>()                  // device of the call
                                  .Arg<ffi::AnyBuffer>()                      // a [M, K]
                                  .Arg<ffi::AnyBuffer>()                      // b [K, Nb]
                                  .Arg<ffi::AnyBuffer>()                      // d_in [M, N]
                                  .Ret<ffi::AnyBuffer>()                      // d, aliases d_in
                                  .Attr<int64_t>("block_m")                   // tile M
                                  .Attr<int64_t>("block_n")                   // tile N
                                  .Attr<int64_t>("stages")                    // pipeline depth
                                  .Attr<int64_t>("cluster_m")                 // CTAs per cluster
                                  .Attr<int64_t>("epilogue")                  // EpilogueKind
                                  .Attr<int64_t>("splits"),                   // split-K ranges
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_tma::ffi_handlers
